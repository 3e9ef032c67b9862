"""usage: what each group's agent used of the model API (counted by the credential proxy)."""

from __future__ import annotations

import argparse

from mdclaw.commands.common import read_db_or_exit
from mdclaw.commands.output import print_rows
from mdclaw.ops.budgets import budget_rows, since_day
from mdclaw.ops.console import load_or_exit
from mdclaw.usage import daily_usage, usage_rows

USAGE_FIELDS = ("group_folder", "model", "requests", "errors", "input_tokens", "output_tokens",
                "first_day", "last_day")
DAY_FIELDS = ("group_folder", "day", "requests", "errors", "input_tokens", "output_tokens")
BUDGET_FIELDS = ("group_folder", "day", "tokens_today", "tokens_per_day", "over")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("usage", parents=[common],
                       help="model requests and tokens per group (from the credential proxy)")
    p.add_argument("--group", "-g", metavar="FOLDER", help="only this group")
    p.add_argument("--days", type=int, metavar="N",
                   help="only the last N days (UTC), today included")
    p.add_argument("--budgets", action="store_true",
                   help="only each group's tokens today against its daily budget "
                        "(limits.tokens_per_day)")
    p.add_argument("--by-day", action="store_true",
                   help="one row per group and UTC day (all models together)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_usage)


def cmd_usage(args: argparse.Namespace) -> int:

    cfg = load_or_exit(args)
    since = None
    if args.days is not None:
        if args.days < 1:
            print("mdclaw: --days must be at least 1")
            return 2
        since = since_day(args.days)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = usage_rows(db, group=args.group, since_day=since)
        days = daily_usage(db, group=args.group, since_day=since) if args.by_day else []
        budgets = budget_rows(cfg, db, args.group)
    if args.by_day:
        print_rows(days, DAY_FIELDS, as_json=args.json, empty="no model requests recorded")
        return 0
    if args.budgets:
        print_rows(budgets, BUDGET_FIELDS, as_json=args.json,
                   empty="no group has a daily token budget (limits.tokens_per_day)")
        return 0
    print_rows(rows, USAGE_FIELDS, as_json=args.json, empty="no model requests recorded")
    if rows and not args.json:
        print(f"total: {sum(r['requests'] for r in rows)} request(s), "
              f"{sum(r['input_tokens'] for r in rows)} input and "
              f"{sum(r['output_tokens'] for r in rows)} output token(s)")
    if budgets and not args.json:
        print(f"daily token budgets ({budgets[0]['day']}, UTC; they reset at midnight UTC):")
        for b in budgets:
            over = " (over budget: model requests refused until midnight UTC)" \
                if b["over"] else ""
            print(f"  {b['group_folder']}: {b['tokens_today']} of {b['tokens_per_day']} "
                  f"tokens today{over}")
    return 0
