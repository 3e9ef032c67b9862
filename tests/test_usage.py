"""The usage ledger on a real database: counts kept in memory until a flush, what today's
tokens add up to before and after one, and counts kept across a flush the database refused."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from mdclaw.state import Database, now_iso
from mdclaw.usage import UsageLedger, daily_usage, record_usage, tokens_on_day, usage_rows


def rows(db: Database) -> list[dict]:
    return [dict(r) for r in db.query(
        "SELECT group_folder, model, requests, errors, input_tokens, output_tokens "
        "FROM model_usage ORDER BY group_folder, model")]


def test_counts_wait_in_memory_until_a_flush_writes_them_once(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")

    async def scenario() -> tuple[list[dict], list[dict], list[dict], dict]:
        ledger = UsageLedger(db, flush_interval=3600)
        ledger.count("family", "m1", ok=True, input_tokens=10, output_tokens=4)
        ledger.count("family", "m1", ok=False)
        ledger.count("main", "m2", ok=True, input_tokens=1, output_tokens=2)
        before = rows(db)
        await ledger.flush()
        after = rows(db)
        await ledger.flush()  # nothing new: nothing written twice
        again = rows(db)
        await ledger.close()
        return before, after, again, ledger.stats

    before, after, again, stats = asyncio.run(scenario())
    assert before == []
    assert after == again == [
        {"group_folder": "family", "model": "m1", "requests": 2, "errors": 1,
         "input_tokens": 10, "output_tokens": 4},
        {"group_folder": "main", "model": "m2", "requests": 1, "errors": 0,
         "input_tokens": 1, "output_tokens": 2}]
    assert stats["family"] == {"requests": 2, "errors": 1, "input_tokens": 10,
                               "output_tokens": 4}


def test_tokens_today_adds_the_database_and_the_unwritten_counts(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    record_usage(db, "family", "m", ok=True, input_tokens=100, output_tokens=50)
    record_usage(db, "family", "m", ok=True, input_tokens=7, output_tokens=7,
                 when="2020-01-01T00:00:00.000Z")  # another day: not today's

    async def scenario() -> list[int]:
        ledger = UsageLedger(db, flush_interval=3600)
        ledger.count("family", "m", ok=True, input_tokens=5, output_tokens=5)
        first = await ledger.tokens_today("family")  # read once: database + memory
        ledger.count("family", "m", ok=True, input_tokens=20, output_tokens=0)
        second = await ledger.tokens_today("family")  # kept up to date by the count
        await ledger.flush()
        third = await ledger.tokens_today("family")
        other = await ledger.tokens_today("main")
        await ledger.close()
        return [first, second, third, other]

    assert asyncio.run(scenario()) == [160, 180, 180, 0]
    assert tokens_on_day(db, "family", now_iso()[:10]) == 180


def test_a_refused_flush_keeps_the_counts_for_the_next_one(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db", timeout=0.05)
    blocker = sqlite3.connect(tmp_path / "state.db", isolation_level=None)

    async def scenario() -> tuple[list[dict], list[dict]]:
        ledger = UsageLedger(db, flush_interval=3600)
        ledger.count("family", "m", ok=True, input_tokens=3, output_tokens=4)
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the database
        await ledger.flush()
        during = rows(db)
        ledger.count("family", "m", ok=True, input_tokens=1, output_tokens=1)
        blocker.execute("ROLLBACK")
        await ledger.flush()
        return during, rows(db)

    during, after = asyncio.run(scenario())
    blocker.close()
    assert during == []
    assert after == [{"group_folder": "family", "model": "m", "requests": 2, "errors": 0,
                      "input_tokens": 4, "output_tokens": 5}]


def test_without_a_database_only_stats_and_the_day_since_it_was_read_count() -> None:
    async def scenario() -> tuple[list[int], dict]:
        ledger = UsageLedger(None)
        ledger.track("family")
        ledger.count("family", "m", ok=True, input_tokens=2, output_tokens=3)
        await ledger.flush()  # nowhere to write: nothing kept for it
        first = await ledger.tokens_today("family")
        ledger.count("family", "m", ok=True, input_tokens=1, output_tokens=1)
        second = await ledger.tokens_today("family")
        await ledger.close()
        return [first, second], ledger.stats

    today, stats = asyncio.run(scenario())
    assert today == [0, 2]
    assert stats == {"family": {"requests": 2, "errors": 0, "input_tokens": 3,
                                "output_tokens": 4}}


def test_usage_queries_filter_by_group_and_day(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    record_usage(db, "a", "m1", ok=True, input_tokens=1, output_tokens=1,
                 when="2026-01-01T10:00:00.000Z")
    record_usage(db, "a", "m2", ok=False, input_tokens=2, output_tokens=0,
                 when="2026-01-02T10:00:00.000Z")
    record_usage(db, "b", "m1", ok=True, input_tokens=5, output_tokens=5,
                 when="2026-01-02T11:00:00.000Z")
    assert [(r["group_folder"], r["model"], r["requests"]) for r in usage_rows(db)] == [
        ("a", "m1", 1), ("a", "m2", 1), ("b", "m1", 1)]
    assert [(r["model"], r["first_day"]) for r in usage_rows(db, group="a",
                                                             since_day="2026-01-02")] == [
        ("m2", "2026-01-02")]
    assert [(r["day"], r["group_folder"], r["errors"], r["input_tokens"])
            for r in daily_usage(db)] == [("2026-01-01", "a", 0, 1), ("2026-01-02", "a", 1, 2),
                                          ("2026-01-02", "b", 0, 5)]
