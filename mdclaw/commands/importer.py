"""`mdclaw import nanoclaw DIR [--apply]`: move in from a NanoClaw v1 install. The reading and
importing is mdclaw.nanoclaw; this prints the plan, the config snippet and what was done."""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path

from mdclaw import nanoclaw
from mdclaw.commands.output import print_json
from mdclaw.errors import MdclawError
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.status import daemon_running
from mdclaw.reconcile import reconcile
from mdclaw.state import Database, DatabaseError


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("import", parents=[common], help="move in from another assistant")
    isub = p.add_subparsers(dest="import_command", required=True)
    nc = isub.add_parser("nanoclaw", parents=[common],
                         help="a NanoClaw v1 install: print the plan and the config for its "
                              "groups; with --apply import tasks, message history and group "
                              "folders (again: changes nothing)")
    nc.add_argument("dir", metavar="DIR", type=Path,
                    help="the NanoClaw folder (with store/messages.db and groups/)")
    nc.add_argument("--apply", action="store_true",
                    help="import into the groups the config has (add the printed groups "
                         "first); the daemon must be stopped")
    nc.add_argument("--json", action="store_true", help="machine-readable output")
    nc.set_defaults(func=cmd_nanoclaw)


def cmd_nanoclaw(args: argparse.Namespace) -> int:
    try:
        plan = nanoclaw.read_install(args.dir)
    except MdclawError as e:
        fail(str(e))
    if not args.apply:
        snippet = nanoclaw.config_snippet(plan)
        if args.json:
            print_json({**plan.as_json(), "config": snippet})
            return 0
        _print_plan(plan)
        if snippet:
            print("\nAdd to config.yaml (then run this again with --apply):\n")
            print(snippet)
        return 0
    cfg = load_or_exit(args)
    if daemon_running(cfg):
        fail("the daemon is running: stop it first, import, then start it")
    try:
        with Database(cfg.db_path) as db:
            reconcile(cfg, db)
            done = nanoclaw.apply(plan, cfg, db)
    except (MdclawError, DatabaseError, sqlite3.Error, OSError) as e:
        fail(f"import failed: {e}")
    if args.json:
        print_json(done.as_json())
        return 0
    if not done.groups:
        print("nothing imported: none of NanoClaw's groups is in the config yet; add them:\n")
        print(nanoclaw.config_snippet(plan))
        return 1
    print(f"imported into {', '.join(done.groups)}: {done.messages} message(s), "
          f"{done.tasks} task(s), {done.files} file(s)"
          + (f", {done.files_beside} beside yours" if done.files_beside else "")
          + ("" if done.changed else " (all there already: nothing changed)"))
    if done.not_configured:
        print(f"not in the config, not imported: {', '.join(done.not_configured)}")
    for p in done.problems:
        print(f"  note: {p}")
    return 0


def _print_plan(plan: nanoclaw.Plan) -> None:
    print(f"NanoClaw install at {plan.root}:")
    for g in plan.groups:
        where = g.mdclaw_jid or f"not importable: {g.channel}"
        print(f"  group {g.folder} ({g.name}{', main' if g.is_main else ''}): {g.jid} -> "
              f"{where}; {g.messages} message(s), {g.tasks} task(s), {len(g.files)} file(s)")
    if plan.has_global:
        print("  groups/global: its files go to mdclaw's groups/global")
    if plan.sessions or plan.task_runs:
        print(f"  not imported: {plan.sessions} agent session(s) (conversations start "
              f"fresh; the memory files come along), {plan.task_runs} task run log(s)")
    for p in plan.problems:
        print(f"  note: {p}")
