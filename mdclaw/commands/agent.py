"""usage: what each group's agent used of the model API (counted by the credential proxy)."""

from __future__ import annotations

import argparse
from datetime import timedelta

from mdclaw.commands.common import load_or_exit, read_db_or_exit
from mdclaw.commands.output import print_rows
from mdclaw.schedule import utc_now

USAGE_FIELDS = ("group_folder", "model", "requests", "errors", "input_tokens", "output_tokens",
                "first_day", "last_day")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("usage", parents=[common],
                       help="model requests and tokens per group (from the credential proxy)")
    p.add_argument("--group", "-g", metavar="FOLDER", help="only this group")
    p.add_argument("--days", type=int, metavar="N",
                   help="only the last N days (UTC), today included")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:
    from mdclaw.proxy import usage_rows

    cfg = load_or_exit(args)
    since = None
    if args.days is not None:
        if args.days < 1:
            print("mdclaw: --days must be at least 1")
            return 2
        since = (utc_now() - timedelta(days=args.days - 1)).strftime("%Y-%m-%d")
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = usage_rows(db, group=args.group, since_day=since)
    print_rows(rows, USAGE_FIELDS, as_json=args.json, empty="no model requests recorded")
    if rows and not args.json:
        print(f"total: {sum(r['requests'] for r in rows)} request(s), "
              f"{sum(r['input_tokens'] for r in rows)} input and "
              f"{sum(r['output_tokens'] for r in rows)} output token(s)")
    return 0
