"""ipc drain, ipc errors, outbox list."""

from __future__ import annotations

import argparse

from mdclaw.commands.common import load_or_exit, open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.paths import Layout

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
    p.set_defaults(func=cmd_drain)
    p = gsub.add_parser("errors", parents=[common], help="list quarantined files and reasons")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_errors)

    o = sub.add_parser("outbox", help="the durable outbox of outbound messages")
    osub = o.add_subparsers(dest="outbox_command", metavar="SUBCOMMAND")
    osub.required = True
    p = osub.add_parser("list", parents=[common], help="list outbox rows, newest first")
    p.add_argument("--status", choices=("pending", "sending", "sent", "failed"),
                   help="only rows with this status")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_outbox_list)


def cmd_drain(args: argparse.Namespace) -> int:
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
    if args.json:
        print_json(summary)
    else:
        print(f"applied {summary['applied']}, rejected {summary['rejected']}, "
              f"pending {summary['pending']}")
    return 0


def cmd_errors(args: argparse.Namespace) -> int:
    from mdclaw.ipc.quarantine import list_errors

    cfg = load_or_exit(args)  # (the quarantine is files: no database needed)
    rows = [e.as_dict() for e in list_errors(Layout(cfg.data_dir).errors_dir)]
    print_rows(rows, ERROR_FIELDS, as_json=args.json, empty="no quarantined files")
    return 0


def cmd_outbox_list(args: argparse.Namespace) -> int:
    from mdclaw.state.outbox import list_outbox

    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = [{k: getattr(r, k) for k in OUTBOX_FIELDS}
                for r in list_outbox(db, status=args.status)]
    print_rows(rows, OUTBOX_FIELDS, as_json=args.json, empty="the outbox is empty")
    return 0
