"""Each group's model tokens today against its daily budget (`mdclaw usage --budgets`, the
operator page's usage view)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from mdclaw.budget import over_budget
from mdclaw.config import Config
from mdclaw.schedule import utc_now
from mdclaw.state import Database
from mdclaw.usage import tokens_on_day


def budget_rows(cfg: Config, db: Database, group: str | None = None) -> list[dict[str, Any]]:
    """Per configured group with a daily token budget: the tokens it used today (UTC, as
    written by the proxy, which flushes every few seconds) against the budget."""
    day = utc_now().strftime("%Y-%m-%d")
    out = []
    for folder in sorted(cfg.groups):
        budget = cfg.token_budget(folder)
        if budget is None or (group and folder != group):
            continue
        used = tokens_on_day(db, folder, day)
        out.append({"group_folder": folder, "day": day, "tokens_today": used,
                    "tokens_per_day": budget, "over": over_budget(used, budget)})
    return out


def since_day(days: int) -> str:
    """The first UTC day of the last `days` days, today included."""
    return (utc_now() - timedelta(days=days - 1)).strftime("%Y-%m-%d")
