"""`mdclaw tasks`: list, show, pause, resume, cancel, run-now and logs of scheduled tasks.

Times in JSON are UTC (as stored); for people, next_run is shown in the task's own timezone.
Changes are written to the state database; a running daemon notices them within its
scheduler's re-check interval (a second), so `run-now` runs the task almost at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from mdclaw import schedule
from mdclaw.commands.common import fail, load_or_exit, open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_table
from mdclaw.config import Config
from mdclaw.state import Database
from mdclaw.state.tasks import (
    TaskError,
    TaskRow,
    cancel_task,
    get_task,
    list_runs,
    list_tasks,
    pause_task,
    resume_task,
    run_now,
)

JSON_FIELDS = ("id", "group_folder", "chat_jid", "prompt", "schedule_type", "schedule_value",
               "context_mode", "status", "next_run", "last_run", "last_result", "source",
               "timezone", "catch_up", "created_at", "updated_at")
TABLE_COLUMNS = ("id", "group", "schedule", "status", "next_run", "source", "prompt")
LOG_COLUMNS = ("id", "due", "started", "status", "duration", "missed", "outcome", "delay")
LATE_CLAIM_S = 2.0  # a claim later than this after the slot is explained in `delay`


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    t = sub.add_parser("tasks", help="scheduled tasks: list, show, pause, resume, cancel, "
                                     "run-now, logs")
    tsub = t.add_subparsers(dest="tasks_command", metavar="SUBCOMMAND")
    tsub.required = True

    p = tsub.add_parser("list", parents=[common], help="list tasks")
    p.add_argument("--group", "-g", metavar="FOLDER", help="only this group's tasks")
    p.add_argument("--json", action="store_true", help="machine-readable output (UTC times)")
    p.set_defaults(func=cmd_list)

    p = tsub.add_parser("show", parents=[common], help="one task and its recent runs")
    p.add_argument("task_id", metavar="ID")
    p.add_argument("--json", action="store_true", help="machine-readable output (UTC times)")
    p.set_defaults(func=cmd_show)

    for name, helptext, func in (
        ("pause", "stop a task from firing until resumed", cmd_pause),
        ("resume", "let a paused task fire again, from its next slot", cmd_resume),
        ("cancel", "end a task for good (its run logs are kept)", cmd_cancel),
        ("run-now", "run a task now (the running daemon picks it up within a second)",
         cmd_run_now),
    ):
        p = tsub.add_parser(name, parents=[common], help=helptext)
        p.add_argument("task_id", metavar="ID")
        p.add_argument("--json", action="store_true", help="print the task as JSON afterwards")
        p.set_defaults(func=func)

    p = tsub.add_parser("logs", parents=[common],
                        help="a task's runs, newest first: when each was due, when it started "
                        "(seconds after due) and why any delay")
    p.add_argument("task_id", metavar="ID")
    p.add_argument("--limit", "-n", type=int, default=20, help="at most N runs (default 20)")
    p.add_argument("--json", action="store_true", help="machine-readable output (UTC times)")
    p.set_defaults(func=cmd_logs)


# ------------------------------------------------------------------ formatting

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


def table_row(t: TaskRow, cfg: Config) -> dict[str, Any]:
    return {"id": t.id, "group": t.group_folder,
            "schedule": f"{t.schedule_type} {t.schedule_value}", "status": t.status,
            "next_run": local_time(t.next_run, zone_for(t, cfg)), "source": t.source,
            "prompt": t.prompt}


def _with_db(args: argparse.Namespace, body: Callable[[Config, Database], int]) -> int:
    """Run a change on the database (created and migrated if need be)."""
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        return body(cfg, db)
    finally:
        db.close()


def _reading(args: argparse.Namespace, body: Callable[[Config, Database], int]) -> int:
    """Run a read-only listing on a ready database (see commands/common.py for the exit
    status when it is not)."""
    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        return body(cfg, db)


def _get_or_fail(db: Database, task_id: str) -> TaskRow:
    t = get_task(db, task_id)
    if t is None:
        fail(f"no task with id {task_id!r}; see: mdclaw tasks list")
    return t


# ------------------------------------------------------------------ commands

def cmd_list(args: argparse.Namespace) -> int:
    def body(cfg: Config, db: Database) -> int:
        rows = list_tasks(db, args.group)
        if args.json:
            print_json([task_json(t) for t in rows])
        else:
            print_table([table_row(t, cfg) for t in rows], TABLE_COLUMNS,
                        empty="no tasks" + (f" in group {args.group!r}" if args.group else ""))
        return 0
    return _reading(args, body)


def cmd_show(args: argparse.Namespace) -> int:
    def body(cfg: Config, db: Database) -> int:
        t = _get_or_fail(db, args.task_id)
        runs = list_runs(db, t.id, limit=5)
        if args.json:
            out = task_json(t)
            out["recent_runs"] = [r.as_dict() for r in runs]
            print_json(out)
            return 0
        tz = zone_for(t, cfg)
        fields = [
            ("id", t.id), ("group", t.group_folder), ("chat", t.chat_jid),
            ("schedule", f"{t.schedule_type} {t.schedule_value}"),
            ("timezone", tz + ("" if t.timezone else " (assistant's)")),
            ("context_mode", t.context_mode), ("catch_up", "yes" if t.catch_up else "no"),
            ("status", t.status), ("source", t.source),
            ("next_run", f"{local_time(t.next_run, tz)} ({t.next_run} UTC)"
             if t.next_run else "-"),
            ("last_run", local_time(t.last_run, tz) or "-"),
            ("last_result", t.last_result or "-"), ("created_at", local_time(t.created_at, tz)),
            ("prompt", t.prompt),
        ]
        width = max(len(k) for k, _ in fields)
        for k, v in fields:
            print(f"{k.ljust(width)}  {v}")
        if runs:
            print("\nrecent runs:")
            print_table([log_row(r, tz) for r in runs], LOG_COLUMNS)
        return 0
    return _reading(args, body)


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


def _change(args: argparse.Namespace, action: str) -> int:
    def body(cfg: Config, db: Database) -> int:
        _get_or_fail(db, args.task_id)
        try:
            before, t = change_task(cfg, db, args.task_id, action)
        except (TaskError, schedule.ScheduleError) as e:
            fail(str(e))
        if args.json:
            print_json(task_json(t))
        else:
            print(change_summary(before, t, action, cfg))
        if t.source == "config" and action == "cancel" and not args.json:
            print(CONFIG_CANCEL_NOTE, file=sys.stderr)
        return 0
    return _with_db(args, body)


def cmd_pause(args: argparse.Namespace) -> int:
    return _change(args, "pause")


def cmd_resume(args: argparse.Namespace) -> int:
    return _change(args, "resume")


def cmd_cancel(args: argparse.Namespace) -> int:
    return _change(args, "cancel")


def cmd_run_now(args: argparse.Namespace) -> int:
    return _change(args, "run-now")


def _seconds(later: str | None, earlier: str | None) -> float | None:
    if not later or not earlier:
        return None
    try:
        return (schedule.from_iso(later) - schedule.from_iso(earlier)).total_seconds()
    except ValueError:
        return None


def _delay(r) -> str:  # noqa: ANN001 - RunLog
    """Why the run started when it did: a late claim (mdclaw was down or busy), and what
    the run then waited for (the run log's start_note)."""
    why = []
    late_claim = _seconds(r.run_at, r.due_at)
    if late_claim is not None and late_claim > LATE_CLAIM_S:
        why.append(f"claimed {late_claim:.1f} s after due (mdclaw was not running then)")
    if r.start_note:
        why.append(r.start_note)
    return "; ".join(why) or "-"


def log_row(r, tz: str) -> dict[str, Any]:  # noqa: ANN001 - RunLog
    outcome = r.result if r.status == "success" else r.error
    after = _seconds(r.started_at, r.due_at or r.run_at)
    started = (f"+{after:.1f}s" if after is not None
               else "not yet" if r.status == "running" else "-")
    return {"id": r.id, "due": local_time(r.due_at or r.run_at, tz), "started": started,
            "status": r.status,
            "duration": "-" if r.status == "running" else f"{r.duration_ms / 1000:.1f}s",
            "missed": r.missed, "outcome": outcome, "delay": _delay(r)}


def cmd_logs(args: argparse.Namespace) -> int:
    def body(cfg: Config, db: Database) -> int:
        t = _get_or_fail(db, args.task_id)
        runs = list_runs(db, t.id, limit=max(1, args.limit))
        if args.json:
            print_json([r.as_dict() for r in runs])
        else:
            print_table([log_row(r, zone_for(t, cfg)) for r in runs], LOG_COLUMNS,
                        empty=f"task {t.id} has not run yet")
        return 0
    return _reading(args, body)
