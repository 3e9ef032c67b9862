"""The scheduler against a real SQLite file: claiming once, run logs, missed runs, waking."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mdclaw import schedule
from mdclaw.scheduler import Claim, Scheduler, Skip
from mdclaw.state import Database
from mdclaw.state.tasks import (
    earliest_next_run,
    get_task,
    insert_task,
    list_runs,
    running_run_id,
    update_task_fields,
)
from waiting import wait_until_async

UTC = UTC


@pytest.fixture
def db(tmp_path: Path):
    d = Database(tmp_path / "state.db")
    yield d
    d.close()


def add(db: Database, tid: str, stype: str = "interval", value: str = "3600000", *,
        due_in: float | None = 0.0, catch_up: bool = True, tz: str = "UTC") -> None:
    """Insert a task; `due_in` seconds from now sets its next_run (negative: overdue)."""
    with db.transaction() as c:
        insert_task(c, group_folder="main", chat_jid="tg:1", prompt=f"prompt {tid}",
                    schedule_type=stype, schedule_value=value, timezone=tz, task_id=tid,
                    catch_up=catch_up, task_timezone=tz)
        if due_in is not None:
            update_task_fields(c, tid, next_run=schedule.to_iso(
                schedule.utc_now() + timedelta(seconds=due_in)))


def once_value(seconds: float) -> str:
    return schedule.to_iso(schedule.utc_now() + timedelta(seconds=seconds))


class Recorder:
    """execute(task): records the call, optionally sleeps or raises."""

    def __init__(self, sleep: float = 0.0, fail: str | None = None) -> None:
        self.calls: list[tuple[str, datetime]] = []
        self.sleep = sleep
        self.fail = fail
        self.active: dict[str, int] = {}
        self.max_active: dict[str, int] = {}

    async def __call__(self, task):
        self.calls.append((task.id, schedule.utc_now()))
        self.active[task.id] = self.active.get(task.id, 0) + 1
        self.max_active[task.id] = max(self.max_active.get(task.id, 0), self.active[task.id])
        try:
            if self.sleep:
                await asyncio.sleep(self.sleep)
            if self.fail:
                raise RuntimeError(self.fail)
            return f"done {task.id}"
        finally:
            self.active[task.id] -= 1

    def ids(self) -> list[str]:
        return [c[0] for c in self.calls]


def asleep(sched: Scheduler) -> bool:
    """The loop waits for its deadline or a wake() (no round under way)."""
    return sched._busy_since is None  # noqa: SLF001


def run_for(sched: Scheduler, seconds: float, during=None, *, done=None) -> None:  # noqa: ANN001
    """Run the scheduler loop for `seconds`, optionally calling `during(sched)` part-way.
    With `done`, first wait until `done()` holds (what must happen, however loaded the
    machine), then run `seconds` more: a window in which what must not happen would."""

    async def main() -> None:
        loop_task = asyncio.create_task(sched.run())
        if during is not None:
            await during(sched)
        if done is not None:
            await wait_until_async(done, 20, what="the scheduler to do it")
        await asyncio.sleep(seconds)
        await sched.stop(timeout=5)
        await loop_task

    asyncio.run(main())


# ------------------------------------------------------------------ claiming

def test_claim_advances_next_run_and_records_start_in_one_step(db) -> None:
    add(db, "t1", "cron", "0 8 * * *", due_in=-1)
    s = Scheduler(db, Recorder())
    before = get_task(db, "t1")
    c = s.claim("t1")
    assert isinstance(c, Claim)
    after = get_task(db, "t1")
    assert schedule.from_iso(after.next_run) > schedule.utc_now()
    assert after.next_run != before.next_run and after.last_run is not None
    (log,) = list_runs(db, "t1")
    assert log.status == "running" and log.id == c.run_id and log.missed == 0
    assert s.claim("t1") is None  # claimed already: not due any more
    assert len(list_runs(db, "t1")) == 1


def test_one_shot_claim_marks_running_and_finish_completes(db) -> None:
    add(db, "o1", "once", once_value(60), due_in=-0.5)
    s = Scheduler(db, Recorder())
    c = s.claim("o1")
    assert isinstance(c, Claim)
    assert get_task(db, "o1").status == "running"
    assert s.claim("o1") is None
    assert s.claim_due() == []
    s.finish(c, "success", result="reminded")
    t = get_task(db, "o1")
    assert (t.status, t.next_run, t.last_result) == ("completed", None, "reminded")


def test_two_schedulers_on_separate_connections_claim_each_task_once(db, tmp_path) -> None:
    for i in range(60):
        add(db, f"t{i:02d}", "interval", "3600000", due_in=-1)
    claims: list[list[Claim]] = [[], [], []]

    def worker(k: int) -> None:
        other = Database(tmp_path / "state.db")
        try:
            s = Scheduler(other, Recorder(), batch=1)
            for _ in range(100):
                claims[k].extend(s.claim_due())
        finally:
            other.close()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = sorted(c.task.id for part in claims for c in part)
    assert got == [f"t{i:02d}" for i in range(60)]
    n = db.query_one("SELECT COUNT(*) FROM task_run_logs WHERE status = 'running'")[0]
    assert n == 60


def test_due_queries_use_the_index(db) -> None:
    for sql in (
        "SELECT next_run FROM scheduled_tasks WHERE status = 'active' AND next_run IS NOT NULL"
        " ORDER BY next_run LIMIT 1",
        "SELECT id FROM scheduled_tasks WHERE status = 'active' AND next_run IS NOT NULL"
        " AND next_run <= '2026' ORDER BY next_run LIMIT 100",
        "SELECT id, status FROM task_run_logs WHERE task_id = 'x' ORDER BY run_at DESC, id DESC"
        " LIMIT 1",
    ):
        plan = " ".join(r[3] for r in db.query("EXPLAIN QUERY PLAN " + sql))
        assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, plan
        assert "TEMP B-TREE" not in plan and not plan.startswith("SCAN"), plan


# ------------------------------------------------------------------ the loop

def test_loop_fires_due_task_on_time_and_records_success(db) -> None:
    add(db, "o1", "once", once_value(1.2), due_in=None)
    due = schedule.from_iso(get_task(db, "o1").next_run)
    rec = Recorder(sleep=0.2)
    run_for(Scheduler(db, rec), 0.3, done=lambda: get_task(db, "o1").status == "completed")
    assert rec.ids() == ["o1"]
    late = (rec.calls[0][1] - due).total_seconds()
    assert 0 <= late < 1.0, late
    t = get_task(db, "o1")
    assert (t.status, t.last_result) == ("completed", "done o1")
    (log,) = list_runs(db, "o1")
    assert log.status == "success" and log.result == "done o1" and log.error is None
    assert 200 <= log.duration_ms < 2000 and log.finished_at


def test_error_is_recorded_with_reason(db) -> None:
    add(db, "t1", "interval", "3600000", due_in=-0.1)
    run_for(Scheduler(db, Recorder(fail="model unavailable")), 0.5,
            done=lambda: [r.status for r in list_runs(db, "t1")] == ["error"])
    (log,) = list_runs(db, "t1")
    assert log.status == "error" and log.error == "RuntimeError: model unavailable"
    t = get_task(db, "t1")
    assert t.last_result == "error: RuntimeError: model unavailable" and t.status == "active"


def test_interval_runs_stay_on_grid(db) -> None:
    add(db, "t1", "interval", "1000", due_in=0.3)
    anchor = schedule.from_iso(get_task(db, "t1").next_run)
    rec = Recorder()
    run_for(Scheduler(db, rec), 0, done=lambda: len(rec.calls) >= 3)
    assert 3 <= len(rec.calls) <= 4
    for k, (_, at) in enumerate(rec.calls):
        slot = anchor + timedelta(seconds=k)
        assert 0 <= (at - slot).total_seconds() < 0.9  # each run in its own 1 s slot
    nxt = schedule.from_iso(get_task(db, "t1").next_run)
    assert (nxt - anchor) % timedelta(seconds=1) == timedelta(0)


def test_wake_picks_up_a_new_task_without_polling(db) -> None:
    rec = Recorder()
    s = Scheduler(db, rec, max_sleep=30)

    async def during(sched: Scheduler) -> None:
        # for up to 30 s now
        await wait_until_async(lambda: asleep(sched), 20, what="the loop to sleep")
        add(db, "late", "interval", "3600000", due_in=0)
        await asyncio.sleep(0.5)
        assert rec.ids() == []  # not noticed: nothing woke it
        sched.wake()
        await wait_until_async(lambda: rec.ids() == ["late"], 10, what="the woken loop to run it")

    run_for(s, 0, during)


def test_wake_from_another_thread(db) -> None:
    rec = Recorder()
    s = Scheduler(db, rec, max_sleep=30)

    async def during(sched: Scheduler) -> None:
        # for up to 30 s now
        await wait_until_async(lambda: asleep(sched), 20, what="the loop to sleep")

        def other() -> None:
            add(db, "t", "interval", "3600000", due_in=0)
            sched.wake()

        await asyncio.to_thread(other)
        await wait_until_async(lambda: rec.ids() == ["t"], 10, what="the woken loop to run it")
        await asyncio.sleep(0.3)
        assert rec.ids() == ["t"]

    run_for(s, 0, during)


def test_changes_by_other_processes_are_seen_within_max_sleep(db, tmp_path) -> None:
    rec = Recorder()
    s = Scheduler(db, rec, max_sleep=1.0)

    async def during(sched: Scheduler) -> None:
        await asyncio.sleep(0.2)
        other = Database(tmp_path / "state.db")  # like `mdclaw tasks run-now` would
        add(other, "ext", "interval", "3600000", due_in=0)
        other.close()
        # Within max_sleep (1 s); 5 s leaves room for a loaded machine and still fails a
        # loop that sleeps until its own idea of the next task (none: no deadline at all).
        await wait_until_async(lambda: rec.ids() == ["ext"], 5, what="the change to be seen")

    run_for(s, 0, during)


def test_task_is_not_started_while_its_previous_run_goes_on(db) -> None:
    add(db, "slow", "interval", "1000", due_in=0)
    rec = Recorder(sleep=2.5)
    run_for(Scheduler(db, rec), 0.2, done=lambda: len(rec.calls) >= 2)
    assert rec.max_active["slow"] == 1
    assert len(rec.calls) == 2  # at 0 s and, after the 2.5 s run, at the 3 s slot
    gap = (rec.calls[1][1] - rec.calls[0][1]).total_seconds()
    assert 2.9 < gap < 3.5, gap
    assert [r.status for r in list_runs(db, "slow")] == ["success", "success"]


# ------------------------------------------------------------------ missed runs

def test_overdue_interval_task_fires_once_and_counts_missed(db) -> None:
    add(db, "t1", "interval", "60000", due_in=-(10 * 60 + 30))
    anchor = schedule.from_iso(get_task(db, "t1").next_run)
    rec = Recorder()
    run_for(Scheduler(db, rec), 0.5, done=lambda: list_runs(db, "t1"))
    assert rec.ids() == ["t1"]
    (log,) = list_runs(db, "t1")
    assert log.missed == 10 and log.status == "success"
    nxt = schedule.from_iso(get_task(db, "t1").next_run)
    assert nxt == anchor + timedelta(minutes=11)


def test_overdue_cron_task_fires_once(db) -> None:
    add(db, "c1", "cron", "*/5 * * * *", due_in=None)
    first = schedule.from_iso(get_task(db, "c1").next_run)
    with db.transaction() as c:  # as if mdclaw had been down for two hours
        update_task_fields(c, "c1", next_run=schedule.to_iso(first - timedelta(hours=2)))
    rec = Recorder()
    run_for(Scheduler(db, rec), 0.5, done=lambda: list_runs(db, "c1"))
    assert rec.ids() == ["c1"]
    (log,) = list_runs(db, "c1")
    assert log.missed == 23  # the 5-minute slots between the one that ran and the next
    assert get_task(db, "c1").next_run == schedule.to_iso(first)


def test_catch_up_false_skips_the_missed_run(db) -> None:
    add(db, "t1", "interval", "60000", due_in=-600, catch_up=False)
    add(db, "o1", "once", once_value(30), due_in=-600, catch_up=False)
    add(db, "ok", "interval", "60000", due_in=-1, catch_up=False)  # only just due: runs
    rec = Recorder()
    run_for(Scheduler(db, rec), 0.5, done=lambda: list_runs(db, "ok") and all(
        get_task(db, t).last_result for t in ("t1", "o1")))
    assert rec.ids() == ["ok"]
    t1 = get_task(db, "t1")
    assert list_runs(db, "t1") == []
    assert schedule.from_iso(t1.next_run) > schedule.utc_now()
    assert "skipped: 11 slot(s) missed" in t1.last_result and "catch_up: false" in t1.last_result
    o1 = get_task(db, "o1")
    assert o1.status == "completed" and o1.next_run is None and "skipped" in o1.last_result


def test_claim_with_injected_clock_counts_missed_slots(db) -> None:
    add(db, "t1", "interval", "1000", due_in=None)
    start = schedule.from_iso(get_task(db, "t1").next_run)
    clock = [start + timedelta(seconds=5.5)]
    s = Scheduler(db, Recorder(), clock=lambda: clock[0])
    c = s.claim("t1")
    assert isinstance(c, Claim) and c.missed == 5
    assert get_task(db, "t1").next_run == schedule.to_iso(start + timedelta(seconds=6))


def test_bad_schedule_in_database_pauses_task_instead_of_spinning(db) -> None:
    add(db, "t1", "cron", "0 8 * * *", due_in=-1)
    with db.transaction() as c:
        update_task_fields(c, "t1", timezone="Nowhere/Land")
    s = Scheduler(db, Recorder())
    r = s.claim("t1")
    assert isinstance(r, Skip)
    t = get_task(db, "t1")
    assert t.status == "paused" and "unknown timezone" in t.last_result


# ------------------------------------------------------------------ stop and recovery

def test_stop_records_runs_in_progress_as_interrupted(db) -> None:
    add(db, "long", "interval", "3600000", due_in=0)
    s = Scheduler(db, Recorder(sleep=60))

    async def main() -> None:
        loop_task = asyncio.create_task(s.run())
        await wait_until_async(lambda: s.running() == ["long"], 20, what="the run to start")
        await s.stop(timeout=0.2)
        await loop_task

    asyncio.run(main())
    (log,) = list_runs(db, "long")
    assert log.status == "interrupted" and "mdclaw stopped" in log.error


def test_recover_marks_left_over_runs_interrupted_and_does_not_refire(db) -> None:
    add(db, "rec", "cron", "0 8 * * *", due_in=-1)
    add(db, "one", "once", once_value(60), due_in=-1)
    first = Scheduler(db, Recorder())
    assert len(first.claim_due()) == 2  # claimed, then "the process died"
    assert running_run_id(db, "rec") is not None
    rec = Recorder()
    second = Scheduler(db, rec)
    assert len(second.recover()) == 2
    assert running_run_id(db, "rec") is None
    run_for(second, 0.5)
    assert rec.ids() == []
    assert [r.status for r in list_runs(db, "rec")] == ["interrupted"]
    assert [r.status for r in list_runs(db, "one")] == ["interrupted"]
    one = get_task(db, "one")
    assert one.status == "completed" and one.last_result.startswith("interrupted")
    assert schedule.from_iso(get_task(db, "rec").next_run) > schedule.utc_now()


def test_earliest_next_run_ignores_paused_and_completed(db) -> None:
    add(db, "a", "interval", "3600000", due_in=100)
    add(db, "b", "interval", "3600000", due_in=50)
    with db.transaction() as c:
        update_task_fields(c, "b", status="paused")
    assert earliest_next_run(db) == get_task(db, "a").next_run
    s = Scheduler(db, Recorder())
    assert 99 < (s.next_wakeup() - schedule.utc_now()).total_seconds() <= 100
    # One index seek, whatever the table holds: the plan of every statement it runs is a
    # SEARCH on an index that also gives the order, never a SCAN or a sort.
    ran: list[str] = []
    db.conn.set_trace_callback(ran.append)
    try:
        s.next_wakeup()
    finally:
        db.conn.set_trace_callback(None)
    assert ran
    for sql in ran:
        plan = " / ".join(r[3] for r in db.conn.execute("EXPLAIN QUERY PLAN " + sql))
        assert plan.startswith("SEARCH scheduled_tasks USING") and "INDEX" in plan, plan
        assert "SCAN" not in plan and "TEMP B-TREE" not in plan, plan


def test_one_shot_paused_and_resumed_while_running_does_not_fire_again(db) -> None:
    add(db, "o1", "once", once_value(60), due_in=0)
    rec = Recorder(sleep=1.0)
    s = Scheduler(db, rec)

    async def during(sched: Scheduler) -> None:
        await wait_until_async(lambda: rec.ids() == ["o1"], 20, what="the run to start")
        with db.transaction() as c:  # what a careless pause + resume would do mid-run
            update_task_fields(c, "o1", status="paused")
            update_task_fields(c, "o1", status="active")
        sched.wake()
        await asyncio.sleep(1.2)

    run_for(s, 0.2, during)
    assert rec.ids() == ["o1"]
    o1 = get_task(db, "o1")
    assert o1.status == "completed" and o1.next_run is None
    assert [r.status for r in list_runs(db, "o1")] == ["success"]


def test_recover_completes_one_shot_paused_during_interrupted_run(db) -> None:
    add(db, "o1", "once", once_value(60), due_in=-1)
    assert isinstance(Scheduler(db, Recorder()).claim("o1"), Claim)
    with db.transaction() as c:
        update_task_fields(c, "o1", status="paused")
    Scheduler(db, Recorder()).recover()
    assert get_task(db, "o1").status == "completed"


def test_unreadable_next_run_pauses_task_instead_of_failing_every_tick(db) -> None:
    add(db, "t1", "interval", "60000", due_in=-1)
    with db.transaction() as c:
        update_task_fields(c, "t1", next_run="2000-01-01 soon")
    rec = Recorder()
    run_for(Scheduler(db, rec), 0.3, done=lambda: get_task(db, "t1").status == "paused")
    t = get_task(db, "t1")
    assert rec.ids() == [] and t.status == "paused" and "bad schedule" in t.last_result
