"""Scheduler tick cost with many active tasks.

A tick is what the scheduler loop does each time it wakes: find the due tasks (index range
scan on (status, next_run)) and compute the wake-up time (one index seek for the earliest
next_run). Measured with 100,000 active tasks (plus paused and completed ones) in a real
state.db, with nothing due, with one task due (including its claim transaction), and, for
contrast, the same queries forced to scan the whole table.

Usage: python bench/scheduler_tick.py [--tasks 100000] [--rounds 2000]
Prints one JSON object per figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdclaw import schedule  # noqa: E402
from mdclaw.scheduler import Scheduler  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.tasks import due_task_ids  # noqa: E402


def fill(db: Database, active: int) -> None:
    rng = random.Random(4)
    now = schedule.utc_now()
    stamp = schedule.to_iso(now)
    rows = []
    total = int(active * 1.2)  # plus 10% paused and 10% completed
    for i in range(total):
        status = "active" if i < active else ("paused" if i % 2 else "completed")
        kind = rng.choice(("cron", "interval", "once"))
        value = {"cron": "0 8 * * *", "interval": "3600000",
                 "once": "2030-01-01T00:00:00Z"}[kind]
        nxt = now + timedelta(seconds=rng.uniform(60, 30 * 86400))
        rows.append((f"task-{i:07d}", f"group{i % 50}", "tg:1", "prompt", kind, value,
                     None if status == "completed" else schedule.to_iso(nxt), status, stamp,
                     "ipc", "UTC", 1, stamp))
    with db.transaction() as c:
        c.executemany(
            "INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,"
            " schedule_value, next_run, status, created_at, source, timezone, catch_up,"
            " updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    db.conn.execute("ANALYZE")


def timed(fn, rounds: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU (this thread) milliseconds per call. On a loaded machine the wall
    tail is mostly time spent preempted; the CPU figure is the work itself."""
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.thread_time() - c0) * 1000)
    return wall, cpu


def _p99(xs: list[float]) -> float:
    return xs[max(0, int(len(xs) * 0.99) - 1)]


def report(figure: str, samples: tuple[list[float], list[float]], tasks: int, **extra) -> None:
    wall, cpu = sorted(samples[0]), sorted(samples[1])
    print(json.dumps({
        "bench": "scheduler_tick", "figure": figure, "active_tasks": tasks,
        "rounds": len(wall), "median_ms": round(statistics.median(wall), 4),
        "p99_ms": round(_p99(wall), 4), "max_ms": round(wall[-1], 4),
        "cpu_median_ms": round(statistics.median(cpu), 4), "cpu_p99_ms": round(_p99(cpu), 4),
        "limit_ms": 5.0, **extra}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        db = Database(Path(tmp) / "state.db")
        fill(db, args.tasks)

        async def never(task):  # nothing runs in this benchmark
            raise AssertionError("not reached")

        s = Scheduler(db, never)

        def idle_tick() -> None:
            assert s.claim_due() == []
            s.next_wakeup()

        report("tick_nothing_due", timed(idle_tick, args.rounds), args.tasks)

        # One task due per tick: find it, claim it (a write transaction), compute wake-up.
        ids = [r[0] for r in db.query(
            "SELECT id FROM scheduled_tasks WHERE status = 'active' LIMIT ?", (args.rounds,))]
        past = schedule.to_iso(schedule.utc_now() - timedelta(seconds=1))
        with db.transaction() as c:
            c.executemany("UPDATE scheduled_tasks SET next_run = ? WHERE id = ?",
                          [(past, i) for i in ids])
        s.batch = 1  # one claim per tick, so the figure is per claimed task

        def due_tick() -> None:
            assert len(s.claim_due()) == 1
            s.next_wakeup()

        # The read-only part (find the due tasks and the wake-up time) with due tasks present.
        def find() -> None:
            due_task_ids(db, schedule.utc_now(), 100)
            s.next_wakeup()

        report("find_due_and_wakeup_with_due_tasks", timed(find, args.rounds), args.tasks,
               due=len(ids))
        report("tick_one_due_with_claim", timed(due_tick, args.rounds // 2), args.tasks,
               note="claim = BEGIN IMMEDIATE, re-read, advance next_run, insert run log, "
                    "COMMIT")

        forced = timed(lambda: db.query(
            "SELECT next_run FROM scheduled_tasks NOT INDEXED WHERE status = 'active'"
            " AND next_run IS NOT NULL ORDER BY next_run LIMIT 1"), max(20, args.rounds // 50))
        report("contrast_full_scan_wakeup_query", forced, args.tasks,
               note="same wake-up query with NOT INDEXED: what a full scan would cost")
        plan = " | ".join(r[3] for r in db.query(
            "EXPLAIN QUERY PLAN SELECT next_run FROM scheduled_tasks WHERE status = 'active'"
            " AND next_run IS NOT NULL ORDER BY next_run LIMIT 1"))
        print(json.dumps({"bench": "scheduler_tick", "figure": "wakeup_query_plan",
                          "plan": plan}), flush=True)
        db.close()


if __name__ == "__main__":
    main()
