"""`mdclaw people list|revoke`: the people of the config and the identities admitted to
groups through the owner's admit card (mdclaw.people, mdclaw.state.people)."""

from __future__ import annotations

import argparse

from mdclaw.commands.common import open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.people import admitted_rows, people_rows
from mdclaw.state.people import revoke


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("people", help="people, their roles and identities; admitted senders")
    s = p.add_subparsers(dest="people_command", metavar="ACTION")
    s.required = True
    ls = s.add_parser("list", parents=[common],
                      help="the config's people and the identities admitted to groups")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_list)
    rv = s.add_parser("revoke", parents=[common],
                      help="take back an admission: the identity is an unknown sender again")
    rv.add_argument("channel", help="the channel name (telegram, whatsapp, http, ...)")
    rv.add_argument("sender", help="the sender id as `people list` shows it")
    rv.add_argument("--group", "-g", metavar="FOLDER",
                    help="only this group's admission (default: every group's)")
    rv.add_argument("--json", action="store_true", help="machine-readable output")
    rv.set_defaults(func=cmd_revoke)


def cmd_list(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    people = people_rows(cfg)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        admitted = admitted_rows(db)
    if args.json:
        print_json({"people": people, "admitted": admitted})
        return 0
    print_rows([dict(r, identities=", ".join(f"{c} {i}" for c, ids in r["identities"].items()
                                             for i in ids)) for r in people],
               ("key", "name", "role", "identities", "card_chat"), as_json=False,
               empty="(no people in the config)")
    print()
    print("admitted senders:")
    print_rows(admitted, ("group_folder", "identity", "sender_name", "admitted_by",
                          "admitted_at"), as_json=False, empty="(none)")
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        n = revoke(db, channel=args.channel, sender=args.sender, folder=args.group)
    finally:
        db.close()
    if args.json:
        print_json({"revoked": n})
    elif n:
        print(f"revoked {n} admission(s) of {args.channel} {args.sender}")
    if not n:
        fail(f"{args.channel} {args.sender} is not admitted"
             + (f" to {args.group}" if args.group else " to any group"))
    return 0
