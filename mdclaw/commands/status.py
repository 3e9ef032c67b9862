"""`mdclaw status`, `mdclaw failures` and `mdclaw doctor`: how things are, what failed, and
what to fix. The queries and checks are mdclaw.ops.status and mdclaw.ops.doctor (the operator
page shows the same); this prints them."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

from mdclaw.commands.common import DB_EXIT, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.config import format_size
from mdclaw.ops.console import load_or_exit
from mdclaw.ops.health import for_people, verdict
from mdclaw.ops.status import gather_status
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state.failed_turns import list_failed_turns


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common],
                       help="what the daemon is doing (works whether it runs or not)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("failures", parents=[common],
                       help="failed agent turns: when, which group, the cause, what happened")
    p.add_argument("--group", "-g", metavar="FOLDER", help="only this group")
    p.add_argument("--days", type=float, default=7.0, help="this many days back (default 7)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_failures)
    p = sub.add_parser("doctor", parents=[common],
                       help="check config, data dir, engine, image, channels, clock")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)


def cmd_status(args: argparse.Namespace) -> int:
    """Exit status 0, or DB_EXIT[state] when the database is not ready (everything else
    is still printed)."""
    cfg = load_or_exit(args)
    s = gather_status(cfg)
    code = DB_EXIT[s["database"]]
    if args.json:
        print_json(s)
        return code
    if s["daemon"] == "running":
        print(f"daemon: running (pid {s.get('pid')}, since {s.get('started_at')})")
        print(f"engine: {s.get('engine')}")
        print(f"containers running: {', '.join(s.get('containers') or []) or 'none'}")
        q = s.get("queue") or {}
        print(f"queue: {q.get('pending', 0)} pending, retrying: "
              f"{', '.join(q.get('retrying') or []) or 'none'}")
        ch = s.get("channels") or {}
        states = s.get("channel_states") or {}
        print("channels: " + (", ".join(f"{k} {_channel_word(v, states.get(k))}"
                                        for k, v in ch.items()) or "none"))
        for name, info in (s.get("channel_details") or {}).items():
            print(f"  {name}: {info.get('detail', '')}"
                  + (f" — fix: {info['fix']}" if info.get("fix") else ""))
        if s.get("reload_error"):
            print(f"last reload failed: {s['reload_error']}")
    else:
        print("daemon: not running")
    mail = s.get("email")
    if mail:
        print(f"email: {mail['address']} (IMAP {mail['imap']}, SMTP {mail['smtp']}); "
              f"{mail['senders']}")
    wa = s.get("whatsapp")
    if wa:
        print(f"whatsapp: {wa['link_state']}"
              + (f" ({wa['account']})" if wa.get("account") else "")
              + (f" — fix: {wa['fix']}" if wa.get("fix") else ""))
    mx = s.get("matrix")
    if mx:
        print(f"matrix: {mx['account']} on {mx['homeserver']} ({mx['login']}"
              + (f", device {mx['device']}" if mx.get("device") else "") + ")"
              + (f" — fix: {mx['fix']}" if mx.get("fix") else ""))
    if s["database"] != "ready":
        print(s["database_detail"])
        _print_disk(s.get("disk") or {})
        return code
    problems = s.get("problems") or []
    print(f"health: {verdict(problems)}")
    for p in problems:
        print(f"  {p['level'].upper():4}  {p['text']} (operator page: #{p['view']})")
    print(f"groups: {s['groups']}")
    ob = s.get("outbox") or {}
    print(f"outbox: {ob.get('pending', 0)} pending, {ob.get('sent', 0)} sent, "
          f"{ob.get('failed', 0)} failed")
    for f in s.get("failed_messages") or []:
        print(f"  failed #{f['id']} to {f['chat_jid']}: {for_people(f['error'])}")
    turns = s.get("failed_turns") or []
    print(f"failed turns (24 h): {len(turns) if len(turns) < 5 else '5 or more'}"
          + (" — `mdclaw failures` lists them" if turns else ""))
    for t in turns:
        print(f"  {t['created_at']} {t['group_folder']}: {t['cause']} ({t['outcome']}, "
              f"try {t['attempts']})")
    nt = s.get("next_task")
    print(f"next task: {nt['id']} at {nt['next_run']}" if nt else "next task: none")
    _print_disk(s.get("disk") or {})
    return code


def _channel_word(connected: bool, state: str | None) -> str:
    """up, DOWN, DELIVERIES FAILING or NEEDS ATTENTION (ops.health.channel_state, as the
    daemon published it)."""
    if state == "deliveries failing":
        return "up, DELIVERIES FAILING"
    if state == "needs attention":
        return "up, NEEDS ATTENTION (see below)"
    return "up" if connected else "DOWN"


def _print_disk(disk: dict[str, Any]) -> None:
    if disk.get("free") is None:
        print("disk: free space unknown (data_dir cannot be read)")
    else:
        state = "ok" if disk["host_ok"] else "BELOW the floor: runs are refused"
        print(f"disk: {format_size(disk['free'])} free of {format_size(disk['total'])} "
              f"(keeps {format_size(disk['floor'])} free: {state})")
    for folder, v in (disk.get("groups") or {}).items():
        print(f"  {folder}: {v['summary']}")


FAILURE_FIELDS = ("created_at", "group_folder", "cause", "outcome", "attempts", "messages",
                  "detail")


def cmd_failures(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    since = to_iso(utc_now() - timedelta(days=args.days))
    with read_db_or_exit(cfg, as_json=args.json) as db:
        rows = list_failed_turns(db, group=args.group, since=since, limit=args.limit)
    print_rows(rows, FAILURE_FIELDS, as_json=args.json,
               empty=f"no failed turns in the last {args.days:g} day(s)")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit status: DB_EXIT[state] when the database is not ready (every check is still
    printed), else 1 when a check failed, else 0."""
    # Imported here for the CLI's start-up: the checks bring in aiohttp, the proxy and the
    # integrations (~0.4 s), which only `doctor` needs.
    from mdclaw.ops.doctor import run_checks

    results = run_checks(args.config)
    state = next((r["state"] for r in results if r["check"] == "database"), "ready")
    if state != "ready":
        code = DB_EXIT[state]
    else:
        code = 1 if any(r["level"] == "fail" for r in results) else 0
    if args.json:
        print_json(results)
    else:
        for r in results:
            line = f"{r['level'].upper():4}  {r['check']}: {r['detail']}"
            if r["fix"] and r["level"] != "ok":
                line += f"\n      fix: {r['fix']}"
            print(line)
    return code
