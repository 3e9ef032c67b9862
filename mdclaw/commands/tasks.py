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
from mdclaw.commands.common import open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_table
from mdclaw.config import Config
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.tasks import (
    CONFIG_CANCEL_NOTE,
    change_summary,
    change_task,
    local_time,
    log_row,
    task_json,
    zone_for,
)
from mdclaw.state import Database
from mdclaw.state.tasks import TaskError, TaskRow, get_task, list_runs, list_tasks

TABLE_COLUMNS = ("id", "group", "schedule", "status", "next_run", "source", "prompt")
LOG_COLUMNS = ("id", "due", "started", "status", "duration", "missed", "outcome", "delay")


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
