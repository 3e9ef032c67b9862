"""check-config, reconcile, groups list."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any, Literal

from mdclaw.approvals.rules import effective_rules
from mdclaw.commands.common import open_db_or_exit, read_db_or_exit
from mdclaw.commands.output import print_json, print_rows
from mdclaw.config import (
    Config,
    ConfigError,
    ConfigIssue,
    check_extras,
    check_programs,
    file_key_lines,
    find_config_path,
    issue_at,
    iter_secret_files,
    load_config,
    old_server_key_warnings,
    secret_file_issues,
    sorted_issues,
)
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.email import unanswered_groups
from mdclaw.ops.groups import GROUP_FIELDS, group_listing
from mdclaw.reconcile import ReconcileError, reconcile
from mdclaw.senders import jid_is_group_chat, main_group_warning
from mdclaw.state.groups import Refusals, list_groups, refusals

# Checks beyond the schema; areas add theirs here. Each yields problems, as ConfigIssue or as
# "key.path: message" lines (reported at that key's line). They may look at this machine
# (paths exist, ...), so `check-config --skip-host-checks` leaves them out. Here: a setting
# whose optional dependency (an extra) this install lacks, a program a setting names.
CONFIG_CHECKS: list[Callable[[Config], Iterable[str | ConfigIssue]]] = [check_extras,
                                                                       check_programs]

GROUP_COLUMNS = GROUP_FIELDS + ("other_chats", "senders", "refused")


def open_main_group(cfg: Config) -> Iterable[str]:
    """A warning when the main group answers in a group chat (by its jid's shape) and has no
    allow_senders: every member of that chat would have admin powers."""
    folder = cfg.main_folder
    if folder is None:
        return []
    g = cfg.groups[folder]
    out = []
    for chat in g.all_chats:
        warning = main_group_warning(folder, chat, group_chat=jid_is_group_chat(chat),
                                     policy_set=g.allow_senders is not None)
        if warning:
            out.append(warning)
    return out


_CARD_CHANNELS = {"tg:": "telegram", "wa:": "whatsapp", "hl:": "http", "mail:": "email",
                  "slack:": "slack", "dc:": "discord"}


def undeliverable_cards(cfg: Config) -> Iterable[str]:
    """A warning for each person whose cards would go to a channel that is not enabled (or
    who has no chat for cards at all): their approvals could only be decided on the operator
    page or with the CLI."""
    enabled = {name for name in ("telegram", "whatsapp", "http", "email", "slack", "discord")
               if (section := getattr(cfg.channels, name)) is not None and section.enabled}
    for key, p in cfg.people.items():
        chat = p.card_chat()
        if chat is None:
            yield (f"people.{key}: no identity of a channel with chats (telegram, whatsapp, "
                   "http, email; Slack and Discord need direct_chat: a DM's id is not the "
                   "user's) and no direct_chat: this person's cards go nowhere (they can "
                   "decide on the operator page or with `mdclaw approvals`)")
            continue
        channel = next((c for prefix, c in _CARD_CHANNELS.items() if chat.startswith(prefix)),
                       None)
        if channel is not None and channel not in enabled:
            yield (f"people.{key}: cards go to {chat}, but channels.{channel} is not enabled: "
                   f"enable it, or set people.{key}.direct_chat to a chat of an enabled channel")


# Findings that deserve attention but leave the config valid: printed, exit status 0. They
# look at the config only, so --skip-host-checks keeps them.
CONFIG_WARNINGS: list[Callable[[Config], Iterable[str | ConfigIssue]]] = [
    open_main_group, old_server_key_warnings, unanswered_groups, undeliverable_cards]


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("check-config", parents=[common],
                       help="validate the config; exit 0 valid, 1 invalid")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print nothing when valid (warnings are still printed)")
    p.add_argument("--json", action="store_true",
                   help="print every problem as JSON: a list of {file, line, path, message, "
                        "severity} (severity: error or warning); the exit status is the same")
    p.add_argument("--skip-secrets", action="store_true",
                   help="check everything except that secret files exist and are readable "
                        "(for build-time checks, e.g. NixOS, where secrets appear at run time)")
    p.add_argument("--skip-host-checks", action="store_true",
                   help="check only the config itself, not what it names on this machine "
                        "(group mount paths...); for checks on another machine or at build time")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("reconcile", parents=[common],
                       help="make the state database and folders match the config")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_reconcile)

    g = sub.add_parser("groups", help="registered groups")
    gsub = g.add_subparsers(dest="groups_command", metavar="SUBCOMMAND")
    gsub.required = True
    p = gsub.add_parser("list", parents=[common], help="list registered groups")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_groups_list)


_KEY_PATH = re.compile(r"^([A-Za-z0-9_<>-]+(?:\.[A-Za-z0-9_<>-]+)*): (.*)$", re.DOTALL)


def as_issue(found: str | ConfigIssue, lines: dict[tuple[str, ...], int],
             severity: Literal["error", "warning"]) -> ConfigIssue:
    """A check's finding as an issue at the line of the key it names."""
    if isinstance(found, ConfigIssue):
        path, message = tuple(found.path.split(".")) if found.path else (), found.message
    else:
        m = _KEY_PATH.match(found)
        path, message = (tuple(m.group(1).split(".")), m.group(2)) if m else ((), found)
    return issue_at(path, message, lines, severity)


def config_issues(args: argparse.Namespace) -> tuple[str, Config | None, list[ConfigIssue]]:
    """(file, the config if valid, every issue sorted by line then key path): the schema's
    and the cross-key problems, then (on a valid config) the secret files (unless
    --skip-secrets), the checks beyond the schema and the warnings."""
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        return e.file, None, list(e.issues)
    path = find_config_path(args.config)
    lines = file_key_lines(path)
    issues = [] if args.skip_secrets else secret_file_issues(cfg, lines)
    checks = [] if args.skip_host_checks else CONFIG_CHECKS
    issues += [as_issue(f, lines, "error") for check in checks for f in check(cfg)]
    issues += [as_issue(f, lines, "warning") for check in CONFIG_WARNINGS for f in check(cfg)]
    return str(path), cfg, sorted_issues(issues)


def cmd_check_config(args: argparse.Namespace) -> int:
    file, cfg, issues = config_issues(args)
    errors = sum(1 for i in issues if i.severity == "error")
    warnings = len(issues) - errors
    if args.json:
        print_json([i.as_json(file) for i in issues])
    elif issues:
        counts = ", ".join(f"{n} {what}{'' if n == 1 else 's'}"
                           for n, what in ((errors, "error"), (warnings, "warning")) if n)
        head = f"invalid config {file}" if errors else f"config {file} is valid, with"
        print(f"mdclaw: {head} ({counts}):" if errors else f"mdclaw: {head} {counts}:",
              file=sys.stderr)
        for issue in issues:
            print(f"  {issue.render(file)}", file=sys.stderr)
    if errors:
        return 1
    assert cfg is not None
    if not args.quiet and not args.json:
        secrets = [k for k, _ in iter_secret_files(cfg)]
        print(f"config ok: {len(cfg.groups)} group(s), main: {cfg.main_folder or '-'}, "
              f"{len(cfg.tasks)} task(s), data_dir: {cfg.data_dir}"
              + (f", secret files: {', '.join(secrets)}" if secrets else ""))
        print_approvals(cfg)
    return 0


def print_approvals(cfg: Config) -> None:
    """What needs a person's yes, per group: the rules in force (the built-in defaults
    counted, the config's own named), as `mdclaw approvals rules` lists them in full."""
    if not cfg.people:
        print("approvals: none (no people in the config: nothing waits for a person's yes)")
        return
    for folder in sorted(cfg.groups):
        rules = effective_rules(cfg, folder)
        defaults = sum(1 for r in rules if r.source.startswith("defaults"))
        own = [r.describe() for r in rules if not r.source.startswith("defaults")]
        print(f"approvals for {folder}: {len(rules)} rule(s), the last that matches decides"
              + (f" ({defaults} built-in)" if defaults else "")
              + f"; `mdclaw approvals rules -g {folder}` lists them")
        for line in own:
            print(f"  {line}")


def cmd_reconcile(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    db = open_db_or_exit(cfg)
    try:
        plan = reconcile(cfg, db, dry_run=True)
        if not args.dry_run and not plan.conflicts:
            try:
                plan = reconcile(cfg, db)
            except ReconcileError as e:
                fail(str(e))
    finally:
        db.close()
    if args.json:
        out = plan.as_dict()
        out["applied"] = not args.dry_run and not plan.conflicts
        print_json(out)
    else:
        verb = "would" if args.dry_run else "did"
        if plan.empty and not plan.conflicts:
            print("nothing to do: database and folders match the config")
        for a in plan.actions:
            print(f"{verb}: {a.describe()}")
        for c in plan.conflicts:
            print(f"conflict: {c}")
        for w in plan.warnings:
            print(f"warning: {w}")
    return 1 if plan.conflicts else 0


def _senders_cell(row: dict[str, object]) -> str:
    policy = row["allow_senders"]
    if not isinstance(policy, dict):
        return "everyone"
    n = policy["ids"]
    return f"{policy['mode']}: {n} id{'' if n == 1 else 's'}"


def _chats_cell(row: dict[str, Any]) -> str:
    """The chats a group answers in besides `jid`, and its session mode with several."""
    chats = [str(c) for c in row.get("chats") or ()][1:]
    return f"{', '.join(chats)} ({row.get('session')})" if chats else "-"


def cmd_groups_list(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    with read_db_or_exit(cfg, as_json=args.json) as db:
        counts = refusals(db)
        rows = [group_listing(g, counts.get(g.folder, Refusals())) for g in list_groups(db)]
    if not args.json:
        rows = [{**r, "senders": _senders_cell(r), "other_chats": _chats_cell(r)}
                for r in rows]
    print_rows(rows, GROUP_COLUMNS, as_json=args.json, empty="no groups registered")
    return 0

