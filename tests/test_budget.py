"""Budget policy on its own: when a day is over, when it resets, and what `Budget.check`
answers a request (with a usage source that says what the group used)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from mdclaw.budget import Budget, OverBudget, budget_message, next_reset, over_budget
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
