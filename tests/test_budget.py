"""Budget policy on its own: when a day is over, when it resets, what `Budget.check`
answers a request, and how `Budget.admit` shares what is left among requests in flight
(with a usage source that says what the group used)."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

from mdclaw.budget import (
    DEFAULT_ANSWER_ESTIMATE,
    MAX_ANSWER_TOKENS,
    MAX_CHOICES,
    Budget,
    Need,
    OverBudget,
    Reservation,
    budget_message,
    next_reset,
    over_budget,
    request_need,
)
from mdclaw.failures import TurnFailure, is_group_budget


class Used:
    def __init__(self, **tokens: int) -> None:
        self.tokens = tokens
        self.asked: list[str] = []

    async def tokens_today(self, folder: str) -> int:
        self.asked.append(folder)
        return self.tokens.get(folder, 0)


def test_a_day_is_over_once_its_tokens_reach_the_budget() -> None:
    assert not over_budget(99, 100)
    assert over_budget(100, 100) and over_budget(101, 100)
    assert not over_budget(10**9, None)  # no budget: never over


def test_the_budget_resets_at_the_next_midnight_utc() -> None:
    assert next_reset(datetime(2026, 3, 10, 23, 59, 59, tzinfo=UTC)) == datetime(
        2026, 3, 11, tzinfo=UTC)
    assert next_reset(datetime(2026, 12, 31, 0, 0, tzinfo=UTC)) == datetime(
        2027, 1, 1, tzinfo=UTC)


def test_check_lets_a_request_go_under_the_budget_and_without_one() -> None:
    used = Used(family=99)
    budget = Budget(used)
    assert asyncio.run(budget.check("family", 100)) is None
    assert asyncio.run(budget.check("family", None)) is None
    assert used.asked == ["family"]  # without a budget nothing is looked up


def test_check_refuses_with_the_words_and_the_seconds_until_the_reset() -> None:
    now = datetime(2026, 3, 10, 23, 0, 0, 500_000, tzinfo=UTC)
    got = asyncio.run(Budget(Used(family=120)).check("family", 100, "Europe/Berlin", now=now))
    assert got == OverBudget(used=120, budget=100, retry_after=3600, message=(
        "This chat has used its model budget for today (120 of 100 tokens). It resets at "
        "midnight UTC, 01:00 in Europe/Berlin."))
    # The refusal's words are recognised as the group's own budget, not the provider's.
    assert is_group_budget(TurnFailure("over_budget", api_message=got.message))
    late = datetime(2026, 3, 10, 23, 59, 59, 900_000, tzinfo=UTC)
    assert asyncio.run(Budget(Used(family=100)).check("family", 100, now=late)).retry_after == 1


def test_a_timezone_that_does_not_exist_still_says_midnight_utc() -> None:
    now = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
    assert budget_message(5, 1, "Not/AZone", now=now).endswith("It resets at midnight UTC.")


# --------------------------------------------------------------------------- reservations


class Ledger(Used):
    """What a group used, which the test moves as answers are counted."""

    def count(self, folder: str, tokens: int) -> None:
        self.tokens[folder] = self.tokens.get(folder, 0) + tokens


def test_what_a_request_reserves() -> None:
    assert request_need(300, {"max_tokens": 50}) == Need(300, 50)
    assert request_need(10, {"max_completion_tokens": 70, "max_tokens": 20}).output == 70
    assert request_need(10, {"max_output_tokens": 9}).output == 9
    # Not a bound: the estimate (the API refuses such a body anyway).
    for bad in ("50", 50.0, -5, 0, True, None, [50]):
        assert request_need(10, {"max_tokens": bad}, estimate=777).output == 777
    assert request_need(10, None, estimate=5) == Need(10, 5)
    assert request_need(10, {}) == Need(10, DEFAULT_ANSWER_ESTIMATE)
    # A hostile bound is clamped to something a model could answer in one go.
    assert request_need(10, {"max_tokens": 10**30}).output == MAX_ANSWER_TOKENS
    assert Need(3, 4).total == 7


def test_a_request_for_n_answers_reserves_n_of_them() -> None:
    """OpenAI's `n`: that many choices, each bounded by max_tokens alone."""
    assert request_need(10, {"max_tokens": 20, "n": 50}) == Need(10, 1000)
    assert request_need(10, {"n": 3}, estimate=100).output == 300
    for bad in ("50", 2.0, 0, -1, True, None):
        assert request_need(10, {"max_tokens": 20, "n": bad}).output == 20
    assert request_need(10, {"max_tokens": 20, "n": 10**9}).output == 20 * MAX_CHOICES
    assert request_need(10, {"max_tokens": 10**30, "n": 2}).output == 2 * MAX_ANSWER_TOKENS


def test_requests_go_side_by_side_only_while_the_budget_covers_all_of_them() -> None:
    async def go() -> None:
        used = Ledger(family=0)
        budget = Budget(used)
        a = await budget.admit("family", 100, Need(20, 20))
        b = await budget.admit("family", 100, Need(30, 30))
        assert isinstance(a, Reservation) and isinstance(b, Reservation)
        assert budget.reserved("family") == (2, 100)
        # A third does not fit beside them: it waits (it is not refused: nothing is spent).
        third = asyncio.ensure_future(budget.admit("family", 100, Need(1, 1)))
        await asyncio.sleep(0.05)
        assert not third.done()
        used.count("family", 35)  # a's answer counted, then its reservation given back
        a.release()
        c = await asyncio.wait_for(third, 5)
        assert isinstance(c, Reservation)
        assert budget.reserved("family") == (2, 62)  # 35 used + 62 held <= 100
        a.release()  # twice: nothing more
        assert budget.reserved("family") == (2, 62)
        used.count("family", 70)
        b.release()
        c.release()
        assert budget.reserved("family") == (0, 0)
        refused = await budget.admit("family", 100, Need(1, 1))
        assert isinstance(refused, OverBudget) and refused.used == 105

    asyncio.run(go())


def test_a_request_alone_goes_while_any_budget_is_left_and_the_day_ends_there() -> None:
    async def go() -> None:
        used = Ledger(family=90)
        budget = Budget(used)
        big = await budget.admit("family", 100, Need(500, 500))  # more than is left: alone
        assert isinstance(big, Reservation)
        # Nothing goes beside it, however small.
        small = asyncio.ensure_future(budget.admit("family", 100, Need(0, 1)))
        await asyncio.sleep(0.05)
        assert not small.done()
        used.count("family", 60)  # the one overshoot: 150 of 100
        big.release()
        got = await asyncio.wait_for(small, 5)
        assert isinstance(got, OverBudget) and "150 of 100 tokens" in got.message
        assert budget.reserved("family") == (0, 0)

    asyncio.run(go())


def test_a_waiting_request_cancelled_holds_nothing_and_groups_are_apart() -> None:
    async def go() -> None:
        used = Ledger()
        budget = Budget(used)
        first = await budget.admit("family", 100, Need(60, 0))
        waiting = asyncio.ensure_future(budget.admit("family", 100, Need(60, 0)))
        other = await budget.admit("main", 100, Need(60, 0))  # another group's own budget
        assert isinstance(other, Reservation)
        await asyncio.sleep(0.02)
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert budget.reserved("family") == (1, 60)
        first.release()
        other.release()
        assert budget.reserved("family") == budget.reserved("main") == (0, 0)
        # No budget: nothing is reserved or looked up.
        free = await budget.admit("family", None, Need(10**6, 10**6))
        assert isinstance(free, Reservation) and free.need == Need(0, 0)
        assert budget.reserved("family") == (0, 0)
        free.release()
        assert sorted(used.asked) == ["family", "family", "main"]  # not for the free one

    asyncio.run(go())
