"""`mdclaw approvals list|show|approve|deny|rules`: what waits for a person, the audit of
every decision, the host operator's own decisions, and the rules in force
(mdclaw.ops.approvals, mdclaw.approvals)."""

from __future__ import annotations

import argparse

from mdclaw.approvals.store import STATUSES
from mdclaw.commands.common import open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.ops.approvals import (
    ApprovalError,
    approval_detail,
    approval_rows,
    decide,
    rules_for_groups,
)
from mdclaw.ops.console import fail, load_or_exit


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("approvals", help="what waits for a person's yes; decide it; the rules")
    s = p.add_subparsers(dest="approvals_command", metavar="ACTION")
    s.required = True
    ls = s.add_parser("list", parents=[common], help="approvals, newest first (the audit)")
    ls.add_argument("--status", choices=STATUSES, help="only approvals with this status")
    ls.add_argument("--group", "-g", metavar="FOLDER", help="only this group's")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    sh = s.add_parser("show", parents=[common], help="one approval with the whole request")
    sh.add_argument("id", type=int)
    sh.add_argument("--json", action="store_true", help="machine-readable output")
    sh.set_defaults(func=cmd_show)
    for verb, what in (("approve", "approve (or answer, with --option) a pending approval as "
                                   "the host operator"),
                       ("deny", "deny a pending approval as the host operator")):
        d = s.add_parser(verb, parents=[common], help=what)
        d.add_argument("id", type=int)
        if verb == "approve":
            d.add_argument("--option", type=int, metavar="N",
                           help="a question's answer: its option's number")
        d.add_argument("--json", action="store_true", help="machine-readable output")
        d.set_defaults(func=cmd_decide, verdict=verb)
    r = s.add_parser("rules", parents=[common],
                     help="the approval rules in force per group, in the order they are tried")
    r.add_argument("--group", "-g", metavar="FOLDER", help="only this group")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=cmd_rules)


def cmd_list(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = approval_rows(db, status=args.status, folder=args.group, limit=args.limit)
    if args.json:
        print_json(rows)
        return 0
    print_rows([dict(r, who=r["decided_label"] or "-") for r in rows],
               ("id", "status", "group_folder", "kind", "summary", "approver", "who",
                "created_at", "expires_at"), as_json=False, empty="(no approvals)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        detail = approval_detail(db, args.id)
    if detail is None:
        fail(f"no approval #{args.id}")
    if args.json:
        print_json(detail)
        return 0
    print(f"#{detail['id']} {detail['kind']} of {detail['group_folder']}: {detail['status']}")
    for line in detail["shown"]:
        print(f"  {line}")
    for key in ("rule", "approver", "created_at", "expires_at", "decided_label",
                "decided_via", "decided_at", "outcome"):
        if detail.get(key):
            print(f"{key}: {detail[key]}")
    return 0


def cmd_decide(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        a = decide(db, cfg, args.id, args.verdict, via="cli",
                   option=getattr(args, "option", None))
    except ApprovalError as e:
        fail(str(e))
    finally:
        db.close()
    if args.json:
        print_json(a.as_dict())
    else:
        print(f"#{a.id} {a.status} by {a.decided_label}: {a.summary} (the running daemon "
              "carries it out; without one, at its next start)")
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    if args.group is not None and args.group not in cfg.groups:
        fail(f"no group {args.group!r} in the config (groups: {', '.join(sorted(cfg.groups))})")
    rules = rules_for_groups(cfg, args.group)
    if args.json:
        print_json(rules)
        return 0
    if not cfg.people:
        print("(no people in the config: nothing needs approval)")
    for folder, listing in rules.items():
        print(f"{folder}:")
        for r in listing:
            print(f"  {r['describe']}")
        if not listing:
            print("  (no rules)")
    return 0
