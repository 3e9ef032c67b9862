"""The scheduler: fire each due task once, on time, and record how each run ended.

Claiming is the heart of it. A due task (`active`, `next_run <= now`) is claimed in one
transaction that inserts its 'running' run-log row and either advances `next_run` to the next
slot (recurring tasks) or marks it 'running' and clears `next_run` (one-shot tasks). Only
then is it handed to `execute`. A crash after the claim therefore cannot fire the same slot
again: on the next start `recover()` marks the left-over 'running' rows 'interrupted', and a
one-shot task left 'running' is marked 'completed' (at most once: its agent may already have
acted; the log shows the interrupted run, and `mdclaw tasks run-now` fires it again if a
person wants that).

After downtime an overdue task fires once, not once per missed slot; its run log's `missed`
says how many further slots passed. With `catch_up: false` a task found more than
`late_grace` late is not run at all: it is moved to its next slot and `last_result` says so.

The loop sleeps until the earliest `next_run` (one index seek), at most `max_sleep` seconds so
changes made by other processes (the CLI, a reconcile) are noticed; code in this process calls
`wake()` after changing the task table so the new times take effect at once. The daemon sleeps
it up to `DAEMON_MAX_SLEEP` instead and wakes it whenever its IPC poll sees anything committed
to the database or the wall clock jump (mdclaw.daemon), so an idle scheduler costs nothing.

Liveness (`alive_at()`, the watchdog's probe): a scheduler asleep before its due time is alive
however long it sleeps; one that is late getting back (a deadline or a wake() it has not
answered) or that is stuck in a round ages from that moment, so systemd's watchdog notices.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from mdclaw import metrics, schedule
from mdclaw.state import Database
from mdclaw.state.tasks import (
    TaskRow,
    due_task_ids,
    earliest_next_run,
    finish_run,
    get_task,
    insert_run,
)

log = logging.getLogger("mdclaw.scheduler")

Execute = Callable[[TaskRow], Awaitable[Any]]

MAX_TEXT = 64 * 1024  # result / error text kept per run
MAX_SUMMARY = 2000  # last_result kept on the task
INTERRUPTED = "mdclaw stopped while this run was in progress; the run is not repeated"
# Seconds the daemon's scheduler sleeps at most: its safety net; the daemon wakes it on any
# commit to the database and on a wall-clock jump.
DAEMON_MAX_SLEEP = 60.0


@dataclass(frozen=True)
class Claim:
    """A run that has been claimed: the task as it is after the claim, and its log row."""

    task: TaskRow
    run_id: int
    scheduled_for: datetime
    started_at: datetime
    missed: int


@dataclass(frozen=True)
class Skip:
    """A due slot that was not run, and why (catch_up: false, or the previous run is busy)."""

    task_id: str
    reason: str
    next_run: datetime | None


def _clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 15] + " ...[truncated]"


def result_text(result: Any) -> str | None:
    """What `execute` returned, as the text kept in the run log."""
    if result is None or isinstance(result, str):
        return result
    return str(result)


class Scheduler:
    """Claims due tasks and hands them to `execute(task)`, an async callable.

    `execute` returns the run's result (kept as text) or raises to report an error. Runs go
    on concurrently; a task is never started while its previous run is still going.
    """

    def __init__(self, db: Database, execute: Execute, *,
                 default_timezone: str | Callable[[], str] = "UTC",
                 clock: Callable[[], datetime] = schedule.utc_now,
                 late_grace: timedelta = timedelta(seconds=60), max_sleep: float = 1.0,
                 batch: int = 100) -> None:
        self.db = db
        self.execute = execute
        # A task without a timezone of its own is read in this one; a function (the
        # daemon's: the config's assistant.timezone now) is asked each time.
        self._default_timezone = default_timezone
        self.clock = clock
        self.late_grace = late_grace
        self.max_sleep = max_sleep
        self.batch = batch
        self._running: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._loop_thread: int | None = None
        self._stopping = False
        self.ticks = 0
        # For alive_at(): when the round under way began (None while asleep), and the
        # monotonic time by which a sleeping loop should be back in a round.
        self._busy_since: float | None = time.monotonic()
        self._back_by = math.inf

    # ------------------------------------------------------------------ start-up
    def recover(self) -> list[int]:
        """Mark runs left 'running' by a crash as 'interrupted'; return their log ids.

        One-shot tasks left 'running' become 'completed' and are not fired again.
        Call once at start-up, before the loop claims anything.
        """
        now = self.clock()
        with self.db.transaction() as conn:
            rows = conn.execute(
                "SELECT id, task_id FROM task_run_logs WHERE status = 'running'").fetchall()
            for run_id, task_id in rows:
                finish_run(conn, run_id, "interrupted", now, error=INTERRUPTED)
                conn.execute("UPDATE scheduled_tasks SET last_result = ?, updated_at = ?"
                             " WHERE id = ?", (f"interrupted: {INTERRUPTED}",
                                               schedule.to_iso(now), task_id))
                # A one-shot paused while it ran must not fire again when resumed either.
                conn.execute("UPDATE scheduled_tasks SET status = 'completed', next_run = NULL"
                             " WHERE id = ? AND schedule_type = 'once' AND status = 'paused'",
                             (task_id,))
            stuck = conn.execute(
                "UPDATE scheduled_tasks SET status = 'completed', next_run = NULL,"
                " updated_at = ? WHERE status = 'running'", (schedule.to_iso(now),)).rowcount
        if rows or stuck:
            log.warning("start-up: %d run(s) interrupted by the last stop marked 'interrupted';"
                        " %d one-shot task(s) left running marked completed (not re-fired)",
                        len(rows), stuck)
        return [r[0] for r in rows]

    @property
    def default_timezone(self) -> str:
        tz = self._default_timezone
        return tz if isinstance(tz, str) else tz()

    # ------------------------------------------------------------------ claiming
    def zone_of(self, task: TaskRow) -> str:
        return task.timezone or self.default_timezone

    def claim(self, task_id: str, now: datetime | None = None) -> Claim | Skip | None:
        """Claim one task if it is due. None if it is not (any more) due.

        Everything happens in one transaction: the task is read again, its next slot written
        (or a one-shot marked 'running') and the 'running' run-log row inserted.
        """
        now = now or self.clock()
        with self.db.transaction() as conn:
            task = get_task(conn, task_id)
            if task is None or task.status != "active" or task.next_run is None:
                return None
            stamp = schedule.to_iso(now)
            try:
                scheduled = schedule.from_iso(task.next_run)
                if scheduled > now:
                    return None
                nxt, missed = schedule.advance(task.schedule_type, task.schedule_value,
                                               self.zone_of(task), scheduled, now)
            except ValueError as e:  # ScheduleError, or a next_run that is not a time
                # A schedule that no longer computes (edited by hand, zone removed): stop it
                # rather than spin on it, and say why.
                conn.execute("UPDATE scheduled_tasks SET status = 'paused', last_result = ?,"
                             " updated_at = ? WHERE id = ?",
                             (_clip(f"paused: bad schedule: {e}", MAX_SUMMARY), stamp, task_id))
                log.error("task %s paused: %s", task_id, e)
                return Skip(task_id, f"bad schedule: {e}", None)
            nxt_iso = schedule.to_iso(nxt) if nxt else None
            once = task.schedule_type == "once"

            if task_id in self._running:
                reason = "the previous run is still in progress; this slot is skipped"
                conn.execute("UPDATE scheduled_tasks SET next_run = ?, updated_at = ?"
                             " WHERE id = ?", (nxt_iso, stamp, task_id))
                log.warning("task %s: %s", task_id, reason)
                return Skip(task_id, reason, nxt)

            late = now - scheduled
            if not task.catch_up and late > self.late_grace:
                slots = missed + 1
                reason = (f"skipped: {slots} slot(s) missed while mdclaw was not running "
                          f"(catch_up: false)")
                if once:
                    conn.execute("UPDATE scheduled_tasks SET status = 'completed', next_run ="
                                 " NULL, last_result = ?, updated_at = ? WHERE id = ?",
                                 (reason, stamp, task_id))
                else:
                    conn.execute("UPDATE scheduled_tasks SET next_run = ?, last_result = ?,"
                                 " updated_at = ? WHERE id = ?", (nxt_iso, reason, stamp, task_id))
                log.info("task %s %s; next run %s", task_id, reason, nxt_iso or "none")
                return Skip(task_id, reason, nxt)

            run_id = insert_run(conn, task_id, now, missed, due_at=scheduled)
            if once:
                conn.execute("UPDATE scheduled_tasks SET status = 'running', next_run = NULL,"
                             " last_run = ?, updated_at = ? WHERE id = ?", (stamp, stamp, task_id))
            else:
                conn.execute("UPDATE scheduled_tasks SET next_run = ?, last_run = ?,"
                             " updated_at = ? WHERE id = ?", (nxt_iso, stamp, stamp, task_id))
            claimed = get_task(conn, task_id)
            assert claimed is not None
        if missed:
            log.info("task %s: running once for %d missed slot(s) too", task_id, missed)
        return Claim(claimed, run_id, scheduled, now, missed)

    def claim_due(self, now: datetime | None = None) -> list[Claim]:
        """Claim every task due at `now` (up to `batch`); skipped slots are not returned."""
        now = now or self.clock()
        out = []
        for task_id in due_task_ids(self.db, now, self.batch):
            c = self.claim(task_id, now)
            if isinstance(c, Claim):
                out.append(c)
        return out

    def next_wakeup(self) -> datetime | None:
        """The earliest next_run of any active task (one index seek), or None."""
        nxt = earliest_next_run(self.db)
        return schedule.from_iso(nxt) if nxt else None

    # ------------------------------------------------------------------ running
    def finish(self, claim: Claim, status: str, *, result: str | None = None,
               error: str | None = None) -> None:
        """Record how a run ended: the run log row, last_result, and a one-shot's completion."""
        now = self.clock()
        result, error = _clip(result, MAX_TEXT), _clip(error, MAX_TEXT)
        summary = result if status == "success" else f"{status}: {error}"
        with self.db.transaction() as conn:
            finish_run(conn, claim.run_id, status, now, result=result, error=error)
            conn.execute("UPDATE scheduled_tasks SET last_result = ?, updated_at = ?"
                         " WHERE id = ?", (_clip(summary, MAX_SUMMARY), schedule.to_iso(now),
                                           claim.task.id))
            if claim.task.schedule_type == "once":
                # Completed even if paused or resumed meanwhile (it did run), unless it was
                # given a new time while running.
                conn.execute("UPDATE scheduled_tasks SET status = 'completed', next_run = NULL"
                             " WHERE id = ? AND schedule_type = 'once' AND schedule_value = ?",
                             (claim.task.id, claim.task.schedule_value))

    async def _run(self, claim: Claim) -> None:
        try:
            result = await self.execute(claim.task)
        except asyncio.CancelledError:
            self.finish(claim, "interrupted", error=INTERRUPTED)
            raise
        except Exception as e:  # noqa: BLE001 - the owner's run callback: recorded, goes on
            log.warning("task %s failed: %s", claim.task.id, e)
            self.finish(claim, "error", error=f"{type(e).__name__}: {e}" if str(e)
                        else type(e).__name__)
        else:
            self.finish(claim, "success", result=result_text(result))
        finally:
            self._running.pop(claim.task.id, None)
            self.wake()

    def dispatch(self, claim: Claim) -> asyncio.Task[None]:
        """Start the run of a claimed task on the running loop."""
        t = asyncio.get_running_loop().create_task(self._run(claim),
                                                   name=f"task-run-{claim.task.id}")
        self._running[claim.task.id] = t
        return t

    def _start(self, c: Claim) -> None:
        metrics.SCHEDULER_LATENESS.observe(
            max(0.0, (self.clock() - c.scheduled_for).total_seconds()))
        log.info("task %s: run %d started (slot %s)", c.task.id, c.run_id,
                 schedule.to_iso(c.scheduled_for))
        self.dispatch(c)

    def tick(self) -> int:
        """Claim and start everything due now; return how many runs were started."""
        claims = self.claim_due()
        for c in claims:
            self._start(c)
        self.ticks += 1
        return len(claims)

    async def tick_async(self) -> int:
        """tick(), yielding to the loop between claims: counting a long outage's missed cron
        slots takes up to ~0.1 s per task, and other work must not wait for all of them."""
        now = self.clock()
        started = 0
        for task_id in due_task_ids(self.db, now, self.batch):
            c = self.claim(task_id, now)
            if isinstance(c, Claim):
                self._start(c)
                started += 1
            await asyncio.sleep(0)
        self.ticks += 1
        return started

    def running(self) -> list[str]:
        """Ids of tasks whose run is in progress in this process."""
        return list(self._running)

    # ------------------------------------------------------------------ the loop
    def alive_at(self) -> float:
        """The time.monotonic() the scheduler last counted as making progress: now while it
        sleeps with its deadline ahead and no wake() unanswered; else the moment the round
        under way began or the moment it should have been back."""
        now = time.monotonic()
        busy = self._busy_since
        if busy is not None:
            return busy
        return min(now, self._back_by)

    def wake(self) -> None:
        """Re-read the task table now (call after adding or changing tasks). Thread-safe."""
        if self._busy_since is None:
            self._back_by = min(self._back_by, time.monotonic())
        loop, event = self._loop, self._wake
        if loop is None or event is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    def _delay(self) -> float:
        nxt = self.next_wakeup()
        if nxt is None:
            return self.max_sleep
        return max(0.0, min(self.max_sleep, (nxt - self.clock()).total_seconds()))

    async def run(self) -> None:
        """Recover, then claim and start due tasks until `stop()` is called."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._stopping = False
        self._busy_since = time.monotonic()
        self.recover()
        while not self._stopping:
            self._wake.clear()
            self._busy_since = time.monotonic()  # a round begins: progress
            try:
                started = await self.tick_async()
                delay = 0.0 if started >= self.batch else self._delay()
            except Exception:  # noqa: BLE001 - a locked or broken database must not kill the loop
                log.exception("scheduler tick failed; retrying")
                delay = self.max_sleep
            if delay > 0 and not self._stopping:
                # Asleep: alive until the deadline (a wake() brings it forward to now).
                self._back_by = time.monotonic() + delay
                self._busy_since = None
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                except TimeoutError:
                    pass
                self._busy_since = time.monotonic()
                self._back_by = math.inf
            else:
                await asyncio.sleep(0)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop claiming; wait up to `timeout` s for runs in progress, then cancel them
        (they are recorded as 'interrupted')."""
        self._stopping = True
        self.wake()
        await self.drain(timeout)
        for t in list(self._running.values()):
            t.cancel()
        if self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until no run is in progress (or `timeout` seconds pass)."""
        pending = list(self._running.values())
        if pending:
            await asyncio.wait(pending, timeout=timeout)
