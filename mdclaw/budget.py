"""Budget policy: the daily token budget of a group (`limits.tokens_per_day`).

A group whose requests used its budget for the UTC day (input + output tokens, as the usage
ledger counts them) gets no more model requests until the next midnight UTC. The credential
proxy asks `Budget.check` before it forwards a request ("may this request go?") and answers a
refusal with HTTP 429 `mdclaw_over_budget` and the refusal's words; `mdclaw usage --budgets`
and the operator page show a day as over with `over_budget`.

This module decides; it does not count. What a group used comes from a `TokensToday` (the
usage ledger, mdclaw.usage), so the policy can be tested, and later extended, on its own.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

# How the refusal's words begin: mdclaw.failures tells the group's own budget from the
# provider's quota by it (the agent runner passes the words on as the API's message).
BUDGET_PREFIX = "This chat has used its model budget for today"


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


class Budget:
    """The daily token budget, asked before each model request of a group."""

    def __init__(self, usage: TokensToday) -> None:
        self.usage = usage

    async def check(self, folder: str, tokens_per_day: int | None, timezone: str = "UTC",
                    now: datetime | None = None) -> OverBudget | None:
        """None when `folder`'s request may go (no budget, or some left today), else why
        not. `timezone` is the one the reset time is told in."""
        if tokens_per_day is None:
            return None
        used = await self.usage.tokens_today(folder)
        if not over_budget(used, tokens_per_day):
            return None
        now = now or datetime.now(UTC)
        seconds = max(1, math.ceil((next_reset(now) - now).total_seconds()))
        return OverBudget(used, tokens_per_day,
                          budget_message(used, tokens_per_day, timezone, now), seconds)
