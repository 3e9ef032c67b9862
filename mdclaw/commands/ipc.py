"""ipc drain, ipc errors, ipc delete-error, outbox list, outbox retry, outbox drop."""

from __future__ import annotations

import argparse
import asyncio

from mdclaw.commands.common import open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.config import Config
from mdclaw.ipc.quarantine import QuarantineError, list_errors
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.outbox import change_outbox_row
from mdclaw.ops.quarantine import delete_quarantined
from mdclaw.paths import Layout
from mdclaw.state.outbox import OutboxError, list_outbox

ERROR_FIELDS = ("name", "source_group", "original_file", "error", "processed_at")
OUTBOX_FIELDS = ("id", "chat_jid", "kind", "text", "status", "source_group", "attempts",
                 "next_attempt_at", "last_error")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("ipc", help="the IPC engine: pending command files and quarantine")
    gsub = g.add_subparsers(dest="ipc_command", metavar="SUBCOMMAND")
    gsub.required = True
    p = gsub.add_parser("drain", parents=[common],
                        help="process every pending command file once and print a summary")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--run-actions", action="store_true",
                   help="then run the action requests it queued (memory_search, web_fetch...) "
                        "here, as the daemon's action worker would, until each has its result")
    p.set_defaults(func=cmd_drain)
    p = gsub.add_parser("errors", parents=[common], help="list quarantined files and reasons")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_errors)
    p = gsub.add_parser("delete-error", parents=[common],
                        help="delete a quarantined file and its reason (NAME as `ipc errors` "
                             "lists it)")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_delete_error)

    o = sub.add_parser("outbox", help="the durable outbox of outbound messages")
    osub = o.add_subparsers(dest="outbox_command", metavar="SUBCOMMAND")
    osub.required = True
    p = osub.add_parser("list", parents=[common], help="list outbox rows, newest first")
    p.add_argument("--status", choices=("pending", "sending", "sent", "failed"),
                   help="only rows with this status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_outbox_list)
    for name, helptext, func in (
        ("retry", "give a failed row a fresh set of tries (the running daemon sends it soon)",
         cmd_outbox_retry),
        ("drop", "delete a failed row for good", cmd_outbox_drop),
    ):
        p = osub.add_parser(name, parents=[common], help=helptext)
        p.add_argument("row_id", metavar="ID", type=int)
        p.add_argument("--json", action="store_true", help="print the row as JSON")
        p.set_defaults(func=func)


def cmd_drain(args: argparse.Namespace) -> int:
    # Imported here for the CLI's start-up: the engine and the integrations bring in
    # aiohttp and prometheus_client (over half a second), which only `ipc drain` needs.
    from mdclaw.integrations import load_all
    from mdclaw.ipc.apply import IpcEngine

    load_all()  # off-loop requests are queued here; the daemon's action worker runs them
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        engine = IpcEngine(cfg, db)
        try:
            engine.start()
            res = engine.drain()
            pending = engine.pending_count()
        finally:
            engine.close()
    finally:
        db.close()
    summary = {"applied": res.applied + res.finished, "rejected": res.rejected,
               "pending": pending}
    if args.run_actions:
        summary["actions_run"] = _run_actions(cfg)
    if args.json:
        print_json(summary)
    else:
        print(f"applied {summary['applied']}, rejected {summary['rejected']}, "
              f"pending {summary['pending']}"
              + (f", actions run {summary['actions_run']}" if args.run_actions else ""))
    return 0


def _run_actions(cfg: Config) -> int:
    """Run the queued off-loop actions (memory searches, fetches...) here and now, as the
    daemon's action worker does; safe beside a running daemon (a job is claimed once)."""
    # Imported here for the CLI's start-up: the worker and its metrics (~0.1 s), which only
    # --run-actions needs.
    from mdclaw.ipc.actions import ACTIONS
    from mdclaw.ipc.worker import ActionWorker

    worker = ActionWorker(cfg)
    try:
        return asyncio.run(worker.run_until_idle(
            max(s.timeout for s in ACTIONS.values()) * 2 if ACTIONS else 60.0))
    except TimeoutError as e:
        raise SystemExit(f"mdclaw: {e}") from None
    finally:
        worker.close()


def cmd_errors(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)  # (the quarantine is files: no database needed)
    rows = [e.as_dict() for e in list_errors(Layout(cfg.data_dir).errors_dir)]
    print_rows(rows, ERROR_FIELDS, as_json=args.json, empty="no quarantined files")
    return 0


def cmd_outbox_list(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = [{k: getattr(r, k) for k in OUTBOX_FIELDS}
                for r in list_outbox(db, status=args.status)]
    print_rows(rows, OUTBOX_FIELDS, as_json=args.json, empty="the outbox is empty")
    return 0


def cmd_delete_error(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    try:
        found = delete_quarantined(cfg, args.name)
    except QuarantineError as e:
        fail(str(e))
    if not found:
        fail(f"no quarantined file {args.name!r}; see: mdclaw ipc errors")
    print(f"deleted {args.name}")
    return 0


def _outbox_change(args: argparse.Namespace, action: str, verb: str) -> int:
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        row = change_outbox_row(db, args.row_id, action)
    except OutboxError as e:
        fail(str(e))
    finally:
        db.close()
    if args.json:
        print_json({k: getattr(row, k) for k in OUTBOX_FIELDS})
    else:
        print(f"outbox row {row.id} {verb}")
    return 0


def cmd_outbox_retry(args: argparse.Namespace) -> int:
    return _outbox_change(args, "retry", "will be sent again")


def cmd_outbox_drop(args: argparse.Namespace) -> int:
    return _outbox_change(args, "drop", "dropped")
