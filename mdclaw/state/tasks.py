"""Scheduled tasks: rows of `scheduled_tasks` and their run logs.

Schedules are validated and `next_run` computed with mdclaw.schedule; every timestamp is
ISO-8601 UTC with a trailing Z. Functions taking `conn` run inside the caller's transaction
(so IPC apply can record its ledger row in the same one).
"""

from __future__ import annotations

import sqlite3
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from mdclaw import schedule
from mdclaw.errors import StateError
from mdclaw.state.db import Database, now_iso

TASK_STATUSES = ("active", "paused", "completed", "running")


class TaskError(StateError, ValueError):
    """A task operation that cannot be done (unknown id, duplicate id, bad schedule...)."""


@dataclass(frozen=True)
class TaskRow:
    id: str
    group_folder: str
    chat_jid: str
    prompt: str
    schedule_type: str
    schedule_value: str
    context_mode: str
    next_run: str | None
    last_run: str | None
    last_result: str | None
    status: str
    created_at: str
    source: str
    timezone: str | None
    catch_up: bool
    updated_at: str | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(r: sqlite3.Row) -> TaskRow:
    d = dict(r)
    d["catch_up"] = bool(d["catch_up"])
    return TaskRow(**d)


def new_task_id() -> str:
    return f"task-{uuid.uuid4().hex[:12]}"


def get_task(db_or_conn: Database | sqlite3.Connection, task_id: str) -> TaskRow | None:
    q = "SELECT * FROM scheduled_tasks WHERE id = ?"
    r = (db_or_conn.query_one(q, (task_id,)) if isinstance(db_or_conn, Database)
         else db_or_conn.execute(q, (task_id,)).fetchone())
    return _row(r) if r else None


def list_tasks(db: Database, group_folder: str | None = None,
               include_completed: bool = True) -> list[TaskRow]:
    sql = "SELECT * FROM scheduled_tasks WHERE 1=1"
    params: list[Any] = []
    if group_folder is not None:
        sql += " AND group_folder = ?"
        params.append(group_folder)
    if not include_completed:
        sql += " AND status != 'completed'"
    sql += " ORDER BY created_at, id"
    return [_row(r) for r in db.query(sql, tuple(params))]


def insert_task(conn: sqlite3.Connection, *, group_folder: str, chat_jid: str, prompt: str,
                schedule_type: str, schedule_value: str, timezone: str,
                context_mode: str = "isolated", task_id: str | None = None,
                source: str = "ipc", catch_up: bool = True, task_timezone: str | None = None,
                now: datetime | None = None) -> TaskRow:
    """Validate the schedule, compute next_run and insert the task (in the caller's
    transaction). `timezone` is the zone to evaluate in; `task_timezone` is stored (None:
    follow the assistant's zone). Raises TaskError (duplicate id) or ScheduleError.
    """
    now = now or schedule.utc_now()
    value = schedule.validate(schedule_type, schedule_value, timezone, now)
    nxt = schedule.first_run(schedule_type, value, timezone, now)
    tid = task_id or new_task_id()
    if conn.execute("SELECT 1 FROM scheduled_tasks WHERE id = ?", (tid,)).fetchone():
        raise TaskError(f"a task with id {tid!r} already exists")
    stamp = now_iso(now)
    conn.execute(
        """INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,
               schedule_value, context_mode, next_run, status, created_at, source, timezone,
               catch_up, updated_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'active', ?, ?, ?, ?, ?)""",
        (tid, group_folder, chat_jid, prompt, schedule_type, value, context_mode,
         schedule.to_iso(nxt), stamp, source, task_timezone, int(catch_up), stamp),
    )
    row = get_task(conn, tid)
    assert row is not None
    return row


def update_task_fields(conn: sqlite3.Connection, task_id: str, **fields: Any) -> None:
    """Set columns of one task (names are checked against the table)."""
    allowed = {"prompt", "schedule_type", "schedule_value", "context_mode", "next_run",
               "last_run", "last_result", "status", "chat_jid", "timezone", "catch_up",
               "group_folder", "source"}
    bad = set(fields) - allowed
    if bad:
        raise TaskError(f"cannot update task field(s): {', '.join(sorted(bad))}")
    if not fields:
        return
    fields["updated_at"] = now_iso()
    cols = ", ".join(f"{k} = ?" for k in fields)
    # The column names are checked against `allowed` above; every value is a parameter.
    conn.execute(f"UPDATE scheduled_tasks SET {cols} WHERE id = ?",  # noqa: S608
                 (*fields.values(), task_id))


def delete_task(conn: sqlite3.Connection, task_id: str) -> bool:
    conn.execute("DELETE FROM task_run_logs WHERE task_id = ?", (task_id,))
    return conn.execute("DELETE FROM scheduled_tasks WHERE id = ?", (task_id,)).rowcount > 0


# --------------------------------------------------------------------------- scheduling
# The scheduler's queries. Each one is served by idx_scheduled_tasks_due (status, next_run):
# next_run is stored in one fixed-width UTC format, so text order is time order.

RUN_STATUSES = ("success", "error", "running", "interrupted")


@dataclass(frozen=True)
class RunLog:
    id: int
    task_id: str
    run_at: str
    duration_ms: int
    status: str
    result: str | None
    error: str | None
    missed: int
    finished_at: str | None
    due_at: str | None = None  # the slot this run is for
    started_at: str | None = None  # when the task was handed to the container runner
    start_note: str | None = None  # what the run waited for before it could start

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def earliest_next_run(db_or_conn: Database | sqlite3.Connection) -> str | None:
    """The smallest next_run of any active task (an index seek), or None if there is none."""
    q = ("SELECT next_run FROM scheduled_tasks WHERE status = 'active' AND next_run IS NOT NULL"
         " ORDER BY next_run LIMIT 1")
    r = (db_or_conn.query_one(q) if isinstance(db_or_conn, Database)
         else db_or_conn.execute(q).fetchone())
    return r[0] if r else None


def due_task_ids(db_or_conn: Database | sqlite3.Connection, now: datetime,
                 limit: int = 100) -> list[str]:
    """Ids of active tasks with next_run <= now, earliest first (an index range scan)."""
    q = ("SELECT id FROM scheduled_tasks WHERE status = 'active' AND next_run IS NOT NULL"
         " AND next_run <= ? ORDER BY next_run LIMIT ?")
    params = (schedule.to_iso(now), limit)
    rows = (db_or_conn.query(q, params) if isinstance(db_or_conn, Database)
            else db_or_conn.execute(q, params).fetchall())
    return [r[0] for r in rows]


def running_run_id(conn: sqlite3.Connection | Database, task_id: str) -> int | None:
    """The id of this task's run still marked 'running', if any.

    Runs of one task never overlap, so only the newest log row can be running; reading just
    that row is an index seek however long the task's history is.
    """
    q = ("SELECT id, status FROM task_run_logs WHERE task_id = ?"
         " ORDER BY run_at DESC, id DESC LIMIT 1")
    r = (conn.query_one(q, (task_id,)) if isinstance(conn, Database)
         else conn.execute(q, (task_id,)).fetchone())
    return r[0] if r and r[1] == "running" else None


def insert_run(conn: sqlite3.Connection, task_id: str, run_at: datetime, missed: int = 0,
               due_at: datetime | None = None) -> int:
    """Record the claim of a run (status 'running') for the slot `due_at`; return its id."""
    cur = conn.execute(
        "INSERT INTO task_run_logs (task_id, run_at, duration_ms, status, missed, due_at)"
        " VALUES (?, ?, 0, 'running', ?, ?)",
        (task_id, schedule.to_iso(run_at), missed,
         schedule.to_iso(due_at) if due_at is not None else None))
    return int(cur.lastrowid or 0)


def mark_run_started(db: Database, task_id: str, started_at: datetime,
                     note: str | None = None) -> bool:
    """Record when the task's running run was handed to the container runner, and what it
    waited for first (`note`). The first start counts: a retry does not move it. False if
    the task has no running run (or its start was recorded already)."""
    with db.transaction() as conn:
        run_id = running_run_id(conn, task_id)
        if run_id is None:
            return False
        cur = conn.execute("UPDATE task_run_logs SET started_at = ?, start_note = ?"
                           " WHERE id = ? AND started_at IS NULL",
                           (schedule.to_iso(started_at), note, run_id))
        return cur.rowcount > 0


def finish_run(conn: sqlite3.Connection, run_id: int, status: str, finished_at: datetime, *,
               result: str | None = None, error: str | None = None) -> bool:
    """Close a 'running' run log row with its outcome; False if it was not running any more."""
    if status not in RUN_STATUSES or status == "running":
        raise TaskError(f"a run cannot end with status {status!r}")
    r = conn.execute("SELECT run_at FROM task_run_logs WHERE id = ? AND status = 'running'",
                     (run_id,)).fetchone()
    if r is None:
        return False
    duration = max(0, int((finished_at - schedule.from_iso(r[0])).total_seconds() * 1000))
    conn.execute(
        "UPDATE task_run_logs SET status = ?, duration_ms = ?, result = ?, error = ?,"
        " finished_at = ? WHERE id = ?",
        (status, duration, result, error, schedule.to_iso(finished_at), run_id))
    return True


def list_runs(db: Database, task_id: str, limit: int | None = None) -> list[RunLog]:
    """Run logs of one task, newest first."""
    sql = "SELECT * FROM task_run_logs WHERE task_id = ? ORDER BY run_at DESC, id DESC"
    params: tuple[Any, ...] = (task_id,)
    if limit is not None:
        sql += " LIMIT ?"
        params = (task_id, limit)
    return [RunLog(**dict(r)) for r in db.query(sql, params)]


# --------------------------------------------------------------------------- task changes
# Which change may be made to a task in which status: the one rule. The operations below
# apply it; whatever offers the changes (the CLI, the operator page's buttons) asks it too.

TASK_CHANGES = ("pause", "resume", "cancel", "run-now")
# (change, status) pairs where the task is so already: the change does nothing.
_ALREADY = frozenset({("pause", "paused"), ("resume", "active"), ("cancel", "completed")})


def change_refusal(t: TaskRow, change: str, *, run_in_progress: bool = False) -> str | None:
    """Why `change` (one of TASK_CHANGES) may not be made to task `t` now, in words a person
    can act on; None if it may. `run_in_progress`: a run of the task is still under way
    (`running_run_id`). An allowed change may still do nothing: see `change_does_nothing`."""
    if change == "pause":
        if t.status not in ("active", "paused"):
            return f"task {t.id!r} is {t.status}; only an active task can be paused"
    elif change == "resume":
        if t.status not in ("paused", "active"):
            return f"task {t.id!r} is {t.status}; only a paused task can be resumed"
    elif change == "run-now":
        if run_in_progress or t.status == "running":
            return f"task {t.id!r} is running now; wait for the run to end"
        if t.status == "paused":
            return f"task {t.id!r} is paused; resume it first"
        if t.status == "completed" and t.schedule_type != "once":
            return f"task {t.id!r} was cancelled; it cannot run again"
    elif change != "cancel":
        raise TaskError(f"unknown task change {change!r}; one of {', '.join(TASK_CHANGES)}")
    return None


def change_does_nothing(t: TaskRow, change: str) -> bool:
    """True if the task is so already (pausing a paused one, resuming an active one,
    cancelling a completed one)."""
    return (change, t.status) in _ALREADY


def changes_allowed(t: TaskRow, *, run_in_progress: bool = False) -> list[str]:
    """The TASK_CHANGES that would change task `t` now: not refused, not so already. A
    one-shot run now under way is 'running'; a cancelled or finished task is 'completed'."""
    return [c for c in TASK_CHANGES
            if change_refusal(t, c, run_in_progress=run_in_progress) is None
            and not change_does_nothing(t, c)]


def _check_change(t: TaskRow, change: str, *, run_in_progress: bool = False) -> bool:
    """TaskError if `change` is refused; False if it would do nothing, True if it changes."""
    why = change_refusal(t, change, run_in_progress=run_in_progress)
    if why is not None:
        raise TaskError(why)
    return not change_does_nothing(t, change)


# --------------------------------------------------------------------------- task operations
# Shared by the CLI and IPC: each runs in the caller's transaction and raises TaskError with a
# reason a person can act on. After committing, wake the scheduler if it runs in-process.

def _require(conn: sqlite3.Connection, task_id: str) -> TaskRow:
    t = get_task(conn, task_id)
    if t is None:
        raise TaskError(f"no task with id {task_id!r}")
    return t


def pause_task(conn: sqlite3.Connection, task_id: str) -> TaskRow:
    """Stop an active task from firing until resumed (a run in progress goes on)."""
    t = _require(conn, task_id)
    if not _check_change(t, "pause"):
        return t
    update_task_fields(conn, task_id, status="paused")
    return _require(conn, task_id)


def resume_task(conn: sqlite3.Connection, task_id: str, default_timezone: str,
                now: datetime | None = None) -> TaskRow:
    """Make a paused task active again, with its next slot after now.

    Cron: the next matching time; interval: the next slot of its old grid; once: its time
    (fired at once if it passed while paused).
    """
    t = _require(conn, task_id)
    if not _check_change(t, "resume"):
        return t
    now = now or schedule.utc_now()
    tz = t.timezone or default_timezone
    old = schedule.from_iso(t.next_run) if t.next_run else None
    if t.schedule_type == "cron":
        nxt = schedule.next_cron(t.schedule_value, tz, now)
    elif t.schedule_type == "interval":
        ms = schedule.parse_interval_ms(t.schedule_value)
        nxt = (schedule.next_interval(old, ms, now)[0] if old
               else schedule.first_run("interval", t.schedule_value, tz, now))
    else:
        nxt = schedule.parse_once(t.schedule_value, tz)
    update_task_fields(conn, task_id, status="active", next_run=schedule.to_iso(nxt))
    return _require(conn, task_id)


def cancel_task(conn: sqlite3.Connection, task_id: str) -> TaskRow:
    """End a task for good: status 'completed', no next run. Its run logs are kept."""
    t = _require(conn, task_id)
    if not _check_change(t, "cancel"):
        return t
    update_task_fields(conn, task_id, status="completed", next_run=None)
    return _require(conn, task_id)


def run_now(conn: sqlite3.Connection, task_id: str, now: datetime | None = None) -> TaskRow:
    """Make a task due now, so the scheduler runs it on its next look (within a second or
    two). An interval task's grid restarts from now. A finished one-shot is re-armed."""
    t = _require(conn, task_id)
    _check_change(t, "run-now", run_in_progress=running_run_id(conn, task_id) is not None)
    update_task_fields(conn, task_id, status="active",
                       next_run=schedule.to_iso(now or schedule.utc_now()))
    return _require(conn, task_id)
