"""Scheduled tasks as `mdclaw tasks` and the operator page show and change them: the JSON
shape of a task and of a run, times in the task's own zone, and pause/resume/cancel/run-now.

Times in JSON are UTC (as stored); for people, times are shown in the task's own timezone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mdclaw import schedule
from mdclaw.config import Config
from mdclaw.state import Database
from mdclaw.state.tasks import (
    RunLog,
    TaskError,
    TaskRow,
    cancel_task,
    get_task,
    pause_task,
    resume_task,
    run_now,
)

JSON_FIELDS = ("id", "group_folder", "chat_jid", "prompt", "schedule_type", "schedule_value",
               "context_mode", "status", "next_run", "last_run", "last_result", "source",
               "timezone", "catch_up", "created_at", "updated_at")
LATE_CLAIM_S = 2.0  # a claim later than this after the slot is explained in `delay`


def task_json(t: TaskRow) -> dict[str, Any]:
    d = t.as_dict()
    return {k: d[k] for k in JSON_FIELDS}


def local_time(iso: str | None, tz: str) -> str | None:
    """A stored UTC time as 'YYYY-MM-DD HH:MM:SS ZONE' in `tz` (e.g. CET)."""
    if not iso:
        return None
    try:
        dt = schedule.from_iso(iso).astimezone(schedule.get_zone(tz))
    except (ValueError, schedule.ScheduleError):
        return iso
    return dt.strftime("%Y-%m-%d %H:%M:%S %Z")


def zone_for(t: TaskRow, cfg: Config) -> str:
    return t.timezone or cfg.assistant.timezone


# The state layer's TASK_CHANGES, each with its operation and what it did (for people).
# Which change is allowed for which task is mdclaw.state.tasks.change_refusal, nothing here.
TASK_ACTIONS: dict[str, tuple[Callable[..., TaskRow], str]] = {
    "pause": (pause_task, "paused"),
    "resume": (resume_task, "resumed"),
    "cancel": (cancel_task, "cancelled"),
    "run-now": (run_now, "is due now; the running daemon starts it within a second"),
}


def change_task(cfg: Config, db: Database, task_id: str, action: str) -> tuple[TaskRow, TaskRow]:
    """Pause, resume, cancel or run-now (`action`, a key of TASK_ACTIONS) task `task_id`, as
    `mdclaw tasks <action>` and the operator page do; returns (before, after). Raises
    TaskError (no such task, or the change is not allowed) or ScheduleError."""
    op = TASK_ACTIONS[action][0]
    before = get_task(db, task_id)
    if before is None:
        raise TaskError(f"no task with id {task_id!r}; see: mdclaw tasks list")
    with db.transaction() as conn:
        after = (op(conn, task_id, cfg.assistant.timezone) if op is resume_task
                 else op(conn, task_id))
    return before, after


def change_summary(before: TaskRow, after: TaskRow, action: str, cfg: Config) -> str:
    """What a change did, in one line for people."""
    same = before.status == after.status and before.next_run == after.next_run
    when = local_time(after.next_run, zone_for(after, cfg))
    verb = TASK_ACTIONS[action][1]
    return (f"task {after.id} {'was already ' + after.status if same else verb}"
            + (f"; next run {when}" if when and after.status == "active" else ""))


CONFIG_CANCEL_NOTE = ("note: this task comes from the config; remove it there too, or it stays "
                      "cancelled until its schedule changes")


def _seconds(later: str | None, earlier: str | None) -> float | None:
    if not later or not earlier:
        return None
    try:
        return (schedule.from_iso(later) - schedule.from_iso(earlier)).total_seconds()
    except ValueError:
        return None


def _delay(r: RunLog) -> str:
    """Why the run started when it did: a late claim (mdclaw was down or busy), and what
    the run then waited for (the run log's start_note)."""
    why = []
    late_claim = _seconds(r.run_at, r.due_at)
    if late_claim is not None and late_claim > LATE_CLAIM_S:
        why.append(f"claimed {late_claim:.1f} s after due (mdclaw was not running then)")
    if r.start_note:
        why.append(r.start_note)
    return "; ".join(why) or "-"


def log_row(r: RunLog, tz: str) -> dict[str, Any]:
    outcome = r.result if r.status == "success" else r.error
    after = _seconds(r.started_at, r.due_at or r.run_at)
    started = (f"+{after:.1f}s" if after is not None
               else "not yet" if r.status == "running" else "-")
    return {"id": r.id, "due": local_time(r.due_at or r.run_at, tz), "started": started,
            "status": r.status,
            "duration": "-" if r.status == "running" else f"{r.duration_ms / 1000:.1f}s",
            "missed": r.missed, "outcome": outcome, "delay": _delay(r)}


def change_tasks(cfg: Config, db: Database, task_ids: list[str], action: str
                 ) -> dict[str, object]:
    """`action` on each task of `task_ids` (the operator page's bulk buttons), each as
    change_task: {"done": [ids], "refused": {id: why}}."""
    done: list[str] = []
    refused: dict[str, str] = {}
    for task_id in dict.fromkeys(task_ids):
        try:
            change_task(cfg, db, task_id, action)
        except (TaskError, schedule.ScheduleError) as e:
            refused[task_id] = str(e)
        else:
            done.append(task_id)
    return {"done": done, "refused": refused}


def schedule_text(schedule_type: str, value: str) -> str:
    """A schedule for people: "every 1 h", "every 30 min", "cron 0 8 * * *", "once at ..."."""
    if schedule_type == "interval":
        try:
            ms = schedule.parse_interval_ms(value)
        except schedule.ScheduleError:
            return f"every {value} ms"
        for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000),
                           ("s", 1000)):
            if ms >= size and ms % size == 0:
                return f"every {ms // size} {unit}"
        return f"every {ms / 1000:g} s"
    if schedule_type == "once":
        return f"once at {value}"
    return f"{schedule_type} {value}"
