"""The action worker: runs off-loop actions (network, slow work) away from the IPC loop.

The IPC engine records each off-loop request as an `action_jobs` row in the command's own
transaction (see `mdclaw/ipc/actions.py`). This worker, a task on the daemon's event loop,
claims queued rows and runs their handlers: at most `limits.action_jobs` at once overall and
`limits.action_jobs_per_group` per group, taken round-robin between groups so one group's
burst cannot starve the others. A handler that from then on only waits (ask_agent, for
another agent's answer) says so (`OffloopContext.waiting`): its job keeps its group's slot
but frees its place among `limits.action_jobs`. Its database work (claim, finish) and
result writes run on one thread of its own with its own connection, so the loop only awaits
them.

Exactly one result per request:
- a claim sets status `running` and bumps `attempts`; the attempt number is the claim's
  token: a result is stored only if the row is still `running` with that attempt;
- the result body is stored in the row (`done`/`failed`) before the file is written, and
  `written_at` set after; a crash in between writes the same stored body again at start;
- at start (`recover`), a row left `running` is queued again if it has attempts left, else
  it gets the error result "interrupted by a restart"; rows left `queued` are simply run.
On stop, jobs still running after a short grace are cancelled and left `running`: the next
start finishes them the same way.

A job an approval holds waits in `awaiting_approval` (never claimed). The decision makes it
`queued` (mdclaw.approvals.flow.decide); the worker then runs it if the approval says
approved or answered (the handler sees the decision in `ctx.decision`), and otherwise writes
the result that says who denied it, or that nobody answered in time, without running it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mdclaw import agentfs, metrics
from mdclaw.agentfs import UnsafePath
from mdclaw.config import Config, LiveConfig
from mdclaw.ipc.actions import (
    ActionFailed,
    Decision,
    OffloopContext,
    action_refusal,
    get_spec,
)
from mdclaw.ipc.auth import Caller, Unauthorized
from mdclaw.ipc.writers import write_action_result
from mdclaw.paths import Layout
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state import Database

log = logging.getLogger("mdclaw.ipc.worker")

T = TypeVar("T")

# Seconds between looks when nothing woke the worker: a safety net only. New jobs wake it
# (the engine's on_jobs, after its COMMIT), and so does any commit by another process
# (`mdclaw ipc drain`), seen by the IPC watcher's poll tick (IpcWatcher._poll).
POLL_INTERVAL = 60.0
STOP_GRACE = 5.0  # seconds running jobs get to finish when the daemon stops
INTERRUPTED = "interrupted by a restart"


@dataclass(frozen=True)
class Job:
    id: int
    folder: str
    request_id: str
    action: str
    params: dict[str, Any]
    is_main: bool
    jid: str | None
    attempt: int
    decision: Decision | None = None  # the approval it waited for, decided


def _now() -> str:
    return to_iso(utc_now())


# Jobs a start finds unfinished: running, or finished with the result not yet written.
# Each part seeks the few such rows (idx_action_jobs_status; the partial
# idx_action_jobs_unwritten, which the planner does not take for an OR, nor with statistics
# of a table full of written jobs unless named), never the week of finished jobs.
_COLUMNS = "id, group_folder, request_id, action, status, attempts, max_attempts, result"
LEFT_BY_A_STOP = (
    f"SELECT {_COLUMNS} FROM action_jobs WHERE status = 'running' UNION ALL"  # noqa: S608
    f" SELECT {_COLUMNS} FROM action_jobs INDEXED BY idx_action_jobs_unwritten"
    " WHERE written_at IS NULL AND status IN ('done', 'failed') ORDER BY id")
UNFINISHED_COUNT = (
    "SELECT (SELECT count(*) FROM action_jobs WHERE status IN ('queued', 'running'))"
    " + (SELECT count(*) FROM action_jobs INDEXED BY idx_action_jobs_unwritten"
    " WHERE written_at IS NULL AND status IN ('done', 'failed'))")


class ActionWorker:
    """Runs queued off-loop action jobs until stopped (see module doc)."""

    def __init__(self, cfg: Config | LiveConfig, *, max_concurrent: int | None = None,
                 per_group: int | None = None, poll_interval: float = POLL_INTERVAL,
                 stop_grace: float = STOP_GRACE) -> None:
        # The limits in force are read each time jobs are claimed; a reload wakes the loop,
        # so raised limits take waiting jobs at once.
        self.live = LiveConfig.of(cfg)
        self.live.subscribe(self._config_changed)
        cfg = self.live.current
        self.layout = Layout(cfg.data_dir)
        self._max = max_concurrent
        self._per_group = per_group
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        self.db = Database(cfg.db_path, migrate=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="action-jobs")
        self._ipc_fd: int | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.running: dict[int, tuple[Job, asyncio.Task[None]]] = {}
        # Running jobs whose handler only waits now (OffloopContext.waiting): they hold no
        # slot of limits.action_jobs, only of their group's action_jobs_per_group.
        self.waiting: set[int] = set()
        self.finished = 0  # jobs whose result was stored by this worker

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    def _config_changed(self, old: Config, new: Config) -> None:
        self.wake()

    @property
    def max_concurrent(self) -> int:
        return self._max or self.cfg.limits.action_jobs

    @property
    def per_group(self) -> int:
        return self._per_group or self.cfg.limits.action_jobs_per_group

    # ------------------------------------------------------------------ control
    def wake(self) -> None:
        """New jobs were queued (called on the loop by the IPC engine after its COMMIT)."""
        if self._wake is not None:
            self._wake.set()

    def start(self) -> asyncio.Task[None]:
        """Start serving on the running loop; returns the task."""
        # Made here, not in run(): a stop() right after start() must reach the task.
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self.run(), name="action-worker")
        return self._task

    async def stop(self) -> None:
        """Stop taking jobs; give running ones `stop_grace` seconds, cancel the rest (they
        stay `running` in the database and are finished at the next start)."""
        if self._stop is not None:
            self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def run_until_idle(self, timeout: float = 60.0) -> int:
        """Serve until no job is queued, running or unwritten (for `mdclaw ipc drain
        --run-actions` and tests, without a daemon); returns how many this worker finished.
        TimeoutError if jobs remain after `timeout` seconds (they stay for the next start)."""
        def open_jobs() -> int:  # jobs waiting for a person are not this run's to wait for
            return int(self.db.query(UNFINISHED_COUNT)[0][0])

        self.start()
        try:
            deadline = asyncio.get_running_loop().time() + timeout
            while await self._io(open_jobs):
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"action jobs still open after {timeout:g} s")
                await asyncio.sleep(0.01)
        finally:
            await self.stop()
        return self.finished

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._ipc_fd is not None:
            os.close(self._ipc_fd)
            self._ipc_fd = None
        self.db.close()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        if self._wake is None or self._stop is None:  # run() awaited without start()
            self._wake, self._stop = asyncio.Event(), asyncio.Event()
        await self._io(self.recover)
        stop_task = asyncio.ensure_future(self._stop.wait())
        try:
            while not self._stop.is_set():
                self._wake.clear()
                free = self.max_concurrent - len(self.running.keys() - self.waiting)
                if free > 0:
                    counts = Counter(j.folder for j, _ in self.running.values())
                    for job in await self._io(self._claim, free, counts):
                        task = asyncio.ensure_future(self._run_job(job))
                        self.running[job.id] = (job, task)
                        task.add_done_callback(functools.partial(self._done, job.id))
                wake_task = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({wake_task, stop_task}, timeout=self.poll_interval,
                                   return_when=asyncio.FIRST_COMPLETED)
                wake_task.cancel()
        finally:
            stop_task.cancel()
            await self._drain()

    def _done(self, job_id: int, _task: asyncio.Task[None]) -> None:
        self.running.pop(job_id, None)
        self.waiting.discard(job_id)
        self.wake()

    def _waits(self, job_id: int) -> None:
        """Job `job_id`'s handler only waits from now on: its slot is free for another."""
        if job_id in self.running and job_id not in self.waiting:
            self.waiting.add(job_id)
            self.wake()

    async def _drain(self) -> None:
        tasks = [t for _, t in self.running.values()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.stop_grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            log.warning("action worker: %d job(s) cut short by the stop; they are finished at "
                        "the next start", len(pending))

    # ------------------------------------------------------------------ one job
    async def _run_job(self, job: Job) -> None:
        body: dict[str, Any] = {"requestId": job.request_id}
        timeout = 120.0
        try:
            spec = get_spec(job.action)
            timeout = spec.timeout
            refusal = action_refusal(self.cfg, job.folder, job.is_main, job.action)
            if refusal is not None:
                raise ActionFailed(refusal)
            not_approved = refused_by(job)
            if not_approved is not None:
                raise ActionFailed(not_approved)
            ctx = OffloopContext(Caller(job.folder, job.is_main, job.jid), self.cfg,
                                 self.layout, job.request_id, job.decision,
                                 waiting=self._thread_safe(functools.partial(self._waits,
                                                                             job.id)))
            if inspect.iscoroutinefunction(spec.handler):
                result = await asyncio.wait_for(spec.handler(ctx, job.params), timeout)
            else:
                result = await asyncio.wait_for(
                    asyncio.to_thread(spec.handler, ctx, job.params), timeout)
            if not isinstance(result, dict):
                raise TypeError(f"handler returned {type(result).__name__}, not a dict")
            body.update(status="success", result=result)
        except ActionFailed as e:
            body.update(status="error", error=str(e))
        except Unauthorized as e:
            body.update(status="error", error=f"unauthorized: {e}")
        except TimeoutError:
            body.update(status="error", error=f"{job.action} took longer than {timeout:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any action's bug: the agent gets an error
            log.exception("action worker: %s of %s failed", job.action, job.folder)
            body.update(status="error", error=f"{job.action} failed: {type(e).__name__}")
        body["executedAt"] = _now()
        await self._io(self._finish, job, body)

    @staticmethod
    def _thread_safe(fn: Callable[[], None]) -> Callable[[], None]:
        """`fn` run on this loop, whether called there or from a handler's thread."""
        loop = asyncio.get_running_loop()

        def call() -> None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                fn()
            else:
                loop.call_soon_threadsafe(fn)
        return call

    # ------------------------------------------------------------------ database (thread)
    def _claim(self, free: int, counts: Counter[str]) -> list[Job]:
        """Claim up to `free` queued jobs, round-robin between groups, each group under its
        cap. Reads first (no lock taken when there is nothing to claim)."""
        rows = self.db.query(
            "SELECT j.id, j.group_folder, j.request_id, j.action, j.params, j.is_main,"
            " j.attempts, g.jid, j.approval_id, a.status AS a_status, a.choice AS a_choice,"
            " a.decided_label AS a_by, a.created_at AS a_created, a.expires_at AS a_expires"
            " FROM action_jobs j LEFT JOIN registered_groups g ON g.folder = j.group_folder"
            " LEFT JOIN approvals a ON a.id = j.approval_id"
            " WHERE j.status = 'queued' ORDER BY j.id LIMIT 2000")
        by_group: dict[str, list[Any]] = {}
        for r in rows:
            by_group.setdefault(r["group_folder"], []).append(r)
        picked: list[Any] = []
        counts = Counter(counts)
        while len(picked) < free:
            took = False
            for folder, queue in by_group.items():
                if queue and counts[folder] < self.per_group and len(picked) < free:
                    picked.append(queue.pop(0))
                    counts[folder] += 1
                    took = True
            if not took:
                break
        if not picked:
            return []
        jobs = []
        now = _now()
        with self.db.transaction() as conn:
            for r in picked:
                n = conn.execute(
                    "UPDATE action_jobs SET status = 'running', attempts = attempts + 1,"
                    " started_at = ? WHERE id = ? AND status = 'queued'", (now, r["id"])).rowcount
                if n != 1:
                    continue
                try:
                    params = json.loads(r["params"])
                except ValueError:
                    params = {}
                decision = None
                if r["approval_id"] is not None:
                    decision = Decision(r["approval_id"], r["a_status"] or "expired",
                                        r["a_choice"], r["a_by"])
                jobs.append(Job(r["id"], r["group_folder"], r["request_id"], r["action"],
                                params if isinstance(params, dict) else {},
                                bool(r["is_main"]), r["jid"], r["attempts"] + 1, decision))
        return jobs

    def _finish(self, job: Job, body: dict[str, Any]) -> None:
        """Store the result if this claim still holds the job, then write the file."""
        status = "done" if body.get("status") == "success" else "failed"
        with self.db.transaction() as conn:
            n = conn.execute(
                "UPDATE action_jobs SET status = ?, result = ?, error = ?, finished_at = ?"
                " WHERE id = ? AND status = 'running' AND attempts = ?",
                (status, json.dumps(body, ensure_ascii=False), body.get("error"), _now(),
                 job.id, job.attempt)).rowcount
        if n != 1:
            log.warning("action worker: %s %s of %s was taken over; this result is dropped",
                        job.action, job.request_id, job.folder)
            return
        self.finished += 1
        metrics.action_jobs_finished.get(job.action, status).inc()
        self._write(job.id, job.folder, job.request_id, body)

    def _write(self, job_id: int, folder: str, request_id: str, body: dict[str, Any]) -> None:
        problem = None
        try:
            if self._ipc_fd is None:
                self._ipc_fd = agentfs.open_root(self.layout.ipc_dir)
            with agentfs.opened(self._ipc_fd, folder) as gfd:
                write_action_result(gfd, request_id, body)
        except (OSError, UnsafePath) as e:
            problem = f"result not delivered: {e}"
            log.warning("action worker: %s of %s: %s", request_id, folder, problem)
        with self.db.transaction() as conn:
            conn.execute("UPDATE action_jobs SET written_at = ?, error = coalesce(error, ?)"
                         " WHERE id = ?", (_now(), problem, job_id))

    def recover(self) -> int:
        """Finish what a crash or a stop left: write stored results, queue again or fail
        jobs left running. Returns how many rows it touched."""
        rows = self.db.query(LEFT_BY_A_STOP)
        for r in rows:
            if r["status"] == "running" and r["attempts"] < r["max_attempts"]:
                with self.db.transaction() as conn:
                    conn.execute("UPDATE action_jobs SET status = 'queued' WHERE id = ? AND"
                                 " status = 'running'", (r["id"],))
                log.info("action worker: %s %s of %s queued again after a restart",
                         r["action"], r["request_id"], r["group_folder"])
                continue
            if r["status"] == "running":
                body = {"requestId": r["request_id"], "status": "error",
                        "error": f"{r['action']} was {INTERRUPTED}; ask again if it is "
                                 "still needed", "executedAt": _now()}
                with self.db.transaction() as conn:
                    n = conn.execute(
                        "UPDATE action_jobs SET status = 'failed', result = ?, error = ?,"
                        " finished_at = ? WHERE id = ? AND status = 'running'",
                        (json.dumps(body), INTERRUPTED, _now(), r["id"])).rowcount
                if n != 1:
                    continue
            else:
                try:
                    body = json.loads(r["result"])
                except (TypeError, ValueError):
                    body = {"requestId": r["request_id"], "status": "error",
                            "error": f"{r['action']}: its stored result was unreadable",
                            "executedAt": _now()}
            self._write(r["id"], r["group_folder"], r["request_id"], body)
        return len(rows)

    def counts(self) -> dict[str, int]:
        """Jobs per status (for status pages)."""
        return {r[0]: r[1] for r in self.db.query(
            "SELECT status, count(*) FROM action_jobs GROUP BY status")}


def refused_by(job: Job) -> str | None:
    """Why a job that waited for a person does not run (None: it was approved or answered,
    or it waited for nobody)."""
    d = job.decision
    if d is None or d.status in ("approved", "answered"):
        return None
    which = f"approval #{d.approval_id}"
    if d.status == "denied":
        return f"{job.action} was denied by {d.by or 'the operator'} ({which}); it did not run"
    return (f"{job.action}: nobody answered in time ({which} expired), so it did not run; "
            "ask again later if it is still needed")
