"""Budget policy: the daily token budget of a group (`limits.tokens_per_day`).

A group whose requests used its budget for the UTC day (input + output tokens, as the usage
ledger counts them) gets no more model requests until the next midnight UTC. The credential
proxy answers a refusal with HTTP 429 `mdclaw_over_budget` and the refusal's words;
`mdclaw usage --budgets` and the operator page show a day as over with `over_budget`.

Two questions are asked of a budget:

- `Budget.check`, when a request arrives: is the day over already? (Cheap; also asked of
  requests that produce no tokens: counting tokens, listing models.)
- `Budget.admit`, when a request that makes the model answer is about to be sent upstream
  (after it waited for one of the group's concurrency slots): does what is left of the day's
  budget cover every answer in flight plus this one? Each request in flight holds a
  *reservation* (`Need`: its body's size for its input, and its `max_tokens` or the
  configured estimate for its answer) from that moment until its answer ends and the real
  usage is counted (`Reservation.release`). A request that does not fit beside the ones in
  flight waits for one of them to end and asks again; a request alone may go whenever the day
  is not over, even when its reservation is larger than what is left.

So requests sent at once cannot together spend more than the budget: what a group spends in a
day is at most its budget plus one answer (the one sent alone when less than its reservation
was left), as long as each answer stays within its reservation. The input part is an upper
bound for text (a token stands for at least one byte, and the body spells out every byte);
the answer part is one when the body names `max_tokens` (the API stops there). What can run
past a reservation, and then adds what it ran past: an answer of a request without
`max_tokens` longer than the estimate (`limits.answer_tokens_estimate`), and input the API
adds itself (documents it fetches by URL, server-side tools). docs/security.md says the same.

This module decides; it does not count. What a group used comes from a `TokensToday` (the
usage ledger, mdclaw.usage), so the policy can be tested, and later extended, on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from zoneinfo import ZoneInfo

# How the refusal's words begin: mdclaw.failures tells the group's own budget from the
# provider's quota by it (the agent runner passes the words on as the API's message).
BUDGET_PREFIX = "This chat has used its model budget for today"

# The body fields that bound an answer's tokens (Messages API; Chat Completions, old and new;
# Responses API): the API stops the answer there.
ANSWER_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# The most one answer reserves whatever its body asks (no model answers more in one go; a
# larger number only makes the request go alone, which this keeps sane to print).
MAX_ANSWER_TOKENS = 1_000_000
# The most answers one request may ask for (OpenAI's `n`: the API refuses more).
MAX_CHOICES = 128
DEFAULT_ANSWER_ESTIMATE = 4096


def over_budget(tokens: int, budget: int | None) -> bool:
    """A day's tokens (input + output) reached the group's daily budget: its requests are
    refused, and the day shows as over (`mdclaw usage`, the operator page)."""
    return budget is not None and tokens >= budget


def next_reset(now: datetime | None = None) -> datetime:
    """When the daily token budgets start again: the next midnight UTC."""
    now = now or datetime.now(UTC)
    return datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)


def budget_message(used: int, budget: int, timezone: str = "UTC",
                   now: datetime | None = None) -> str:
    """What the agent (and through it the chat) is told when the group is over its budget:
    how much, and when it resets, in UTC and in the assistant's timezone."""
    reset = next_reset(now)
    when = "midnight UTC"
    if timezone != "UTC":
        with contextlib.suppress(Exception):
            local = reset.astimezone(ZoneInfo(timezone))
            when += f", {local:%H:%M} in {timezone}"
    return f"{BUDGET_PREFIX} ({used} of {budget} tokens). It resets at {when}."


class TokensToday(Protocol):
    """Where the budget learns what a group used today (mdclaw.usage.UsageLedger)."""

    async def tokens_today(self, folder: str) -> int: ...


@dataclass(frozen=True)
class OverBudget:
    """A request refused for the group's daily budget."""

    used: int  # tokens the group used today
    budget: int  # its daily budget
    message: str  # what the agent (and the chat) is told: budget_message
    retry_after: int  # whole seconds until the budget resets (at least 1)


@dataclass(frozen=True)
class Need:
    """Tokens reserved for one request in flight: its input and its answer."""

    input: int
    output: int

    @property
    def total(self) -> int:
        return self.input + self.output


NOTHING = Need(0, 0)


def request_need(body_size: int, body: Any, estimate: int = DEFAULT_ANSWER_ESTIMATE) -> Need:
    """What a request reserves: `body_size` (the bytes sent upstream) for its input, and for
    its answer the largest positive whole `max_tokens` / `max_completion_tokens` /
    `max_output_tokens` its JSON object `body` names (at most MAX_ANSWER_TOKENS), else
    `estimate`. Anything else in those fields (a string, a float, a negative number, a
    boolean) is not a bound: the estimate is reserved (the API refuses such a body anyway).
    A request for `n` answers (OpenAI's choices, each bounded alone) reserves `n` times as
    much, `n` counted up to MAX_CHOICES."""
    def whole(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    fields = body if isinstance(body, dict) else {}
    named = [v for k in ANSWER_LIMIT_FIELDS if (v := whole(fields.get(k))) is not None]
    answer = min(max(named) if named else max(1, estimate), MAX_ANSWER_TOKENS)
    return Need(max(0, body_size), answer * min(whole(fields.get("n")) or 1, MAX_CHOICES))


class Reservation:
    """Tokens held for one request from its dispatch until its answer ended: `release` once
    the real usage is counted (again: nothing)."""

    def __init__(self, budget: Budget | None, folder: str, need: Need) -> None:
        self.folder = folder
        self.need = need
        self._budget = budget

    def release(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._release(self.folder, self.need)


class Budget:
    """The daily token budget, asked when each model request of a group arrives (`check`)
    and when one is sent upstream (`admit`). Use inside one event loop."""

    def __init__(self, usage: TokensToday) -> None:
        self.usage = usage
        # folder -> [requests in flight, tokens they reserve]
        self._held: dict[str, list[int]] = {}
        # folder -> set when one of its reservations is released (requests that did not fit
        # wait on it)
        self._released: dict[str, asyncio.Event] = {}

    async def check(self, folder: str, tokens_per_day: int | None, timezone: str = "UTC",
                    now: datetime | None = None) -> OverBudget | None:
        """None when `folder`'s request may go (no budget, or some left today), else why
        not. `timezone` is the one the reset time is told in."""
        if tokens_per_day is None:
            return None
        used = await self.usage.tokens_today(folder)
        if not over_budget(used, tokens_per_day):
            return None
        return self._refusal(used, tokens_per_day, timezone, now)

    async def admit(self, folder: str, tokens_per_day: int | None, need: Need,
                    timezone: str = "UTC") -> Reservation | OverBudget:
        """At the moment a request is sent upstream: its Reservation of `need` when the
        budget left covers the requests in flight plus it, or when nothing is in flight and
        the day is not over; why not (OverBudget) when the day is over. A request that fits
        only once some in flight have ended waits for that (it is cancelled with its
        handler). Without a budget (`tokens_per_day` None): a reservation of nothing."""
        if tokens_per_day is None:
            return Reservation(None, folder, NOTHING)
        while True:
            used = await self.usage.tokens_today(folder)
            # From here to the decision nothing awaits: the counts are the current ones.
            if over_budget(used, tokens_per_day):
                return self._refusal(used, tokens_per_day, timezone)
            held = self._held.setdefault(folder, [0, 0])
            if held[0] == 0 or used + held[1] + need.total <= tokens_per_day:
                held[0] += 1
                held[1] += need.total
                return Reservation(self, folder, need)
            released = self._released.get(folder)
            if released is None:
                released = self._released[folder] = asyncio.Event()
            await released.wait()

    def reserved(self, folder: str) -> tuple[int, int]:
        """(requests in flight, tokens they reserve) for `folder`."""
        held = self._held.get(folder)
        return (held[0], held[1]) if held else (0, 0)

    def _release(self, folder: str, need: Need) -> None:
        held = self._held.get(folder)
        if held is not None:
            held[0] -= 1
            held[1] -= need.total
            if held[0] <= 0:
                del self._held[folder]
        released = self._released.pop(folder, None)
        if released is not None:
            released.set()  # every waiter asks again

    @staticmethod
    def _refusal(used: int, tokens_per_day: int, timezone: str,
                 now: datetime | None = None) -> OverBudget:
        now = now or datetime.now(UTC)
        seconds = max(1, math.ceil((next_reset(now) - now).total_seconds()))
        return OverBudget(used, tokens_per_day,
                          budget_message(used, tokens_per_day, timezone, now), seconds)
