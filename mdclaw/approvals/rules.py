"""Which request needs whose approval: the one rule, pure, for the daemon, the CLI and the
operator page.

A request is an IPC command (its type: `message`, `send_file`, `register_group`...) or an
action (its name: `ha_call_service`, `web_fetch`, ...), with its arguments. The rules are,
in order: the built-in defaults (`approvals.defaults`, once `people` has an owner), the
global `approvals.rules`, then the group's `approvals`; the last rule that matches decides,
and `approver: none` means no approval.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from fnmatch import fnmatchcase
from typing import Any, Literal

from mdclaw.config import ApprovalMatch, ApprovalRule, Config

# Home Assistant actions that change something (the reads, screenshots and validation do not).
HA_WRITES = ("ha_call_service", "ha_set_entity", "ha_restart", "ha_apply_dashboard",
             "ha_canvas_set_spec", "ha_canvas_patch_spec", "ha_dashboard_patch")
# Commands that send something into a chat: to another group's chat they need the owner.
SENDS = ("message", "send_file", "react", "schedule_task")
COMMAND_ALIASES = {"send_message": "message"}


def _rule(approver: str = "owner", **match: Any) -> ApprovalRule:
    return ApprovalRule(match=ApprovalMatch(**match), approver=approver)


#: What a family would want: the owner says yes to every Home Assistant write, dashboard
#: apply and restart, to group registration, and to anything sent into another group's chat
#: (a message, a file, a reaction, a task that runs there). Reads, web access and the
#: group's own chat need nobody. A dashboard patch that only shows its result (dryRun) is a
#: read.
DEFAULT_RULES: tuple[ApprovalRule, ...] = (
    *(_rule(action=a) for a in HA_WRITES),
    _rule(action="ha_dashboard_patch", args={"dryRun": True}, approver="none"),
    _rule(command="register_group"),
    _rule(command="unregister_group"),
    *(_rule(command=c, to="other_chat") for c in SENDS),
)


@dataclass(frozen=True)
class Request:
    """What a group asks for, as the rules see it."""

    kind: Literal["command", "action"]
    name: str  # the command's canonical type, or the action's name
    args: Mapping[str, Any]
    other_chat: bool = False  # a command that names a chat other than the group's own


@dataclass(frozen=True)
class Rule:
    """A rule in force: where it comes from ("defaults[3]", "approvals.rules[0]",
    "groups.kids.approvals[1]"), who approves, how long a request waits."""

    source: str
    rule: ApprovalRule
    timeout: timedelta

    @property
    def approver(self) -> str:
        return self.rule.approver

    def describe(self) -> str:
        """The rule in a few words, for cards and the audit."""
        m = self.rule.match
        what = f"command {m.command}" if m.command is not None else f"action {m.action}"
        if m.to is not None:
            what += f" to {'another' if m.to == 'other_chat' else 'its own'} chat"
        if m.args:
            what += " with " + ", ".join(f"{k} in {list(v) if isinstance(v, tuple) else [v]}"
                                         for k, v in m.args.items())
        who = "nobody" if self.approver == "none" else self.approver
        return f"{self.source}: {what} -> {who}"


def has_owner(cfg: Config) -> bool:
    return any(p.role == "owner" for p in cfg.people.values())


# The rules of each group under the config in force (the config itself kept, so that one
# made later at the same address is not taken for it): one config at a time.
_CACHE: tuple[Config | None, dict[str, list[Rule]]] = (None, {})


def effective_rules(cfg: Config, folder: str) -> list[Rule]:
    """The rules for group `folder`, in the order they are tried (the last match wins).
    Made once per config and group (the IPC loop asks for every command)."""
    global _CACHE
    of, rules_of = _CACHE
    if of is not cfg:
        # Another config is in force now. (A look at every cached group instead, at each
        # group's first command, made 500,500 of them for 1,000 groups.)
        of, rules_of = _CACHE = (cfg, {})
    rules = rules_of.get(folder)
    if rules is None:
        rules = rules_of[folder] = _effective_rules(cfg, folder)
    return rules


def _effective_rules(cfg: Config, folder: str) -> list[Rule]:
    base = cfg.approvals.timeout
    out: list[Rule] = []
    if cfg.approvals.defaults and has_owner(cfg):
        out += [Rule(f"defaults[{n}]", r, r.timeout or base)
                for n, r in enumerate(DEFAULT_RULES)]
    out += [Rule(f"approvals.rules[{n}]", r, r.timeout or base)
            for n, r in enumerate(cfg.approvals.rules)]
    group = cfg.groups.get(folder)
    if group is not None:
        out += [Rule(f"groups.{folder}.approvals[{n}]", r, r.timeout or base)
                for n, r in enumerate(group.approvals)]
    return out


def matching_rule(cfg: Config, folder: str, request: Request) -> Rule | None:
    """The last configured rule (defaults included) that matches `request` of group
    `folder`, whoever it names (`approver: none` too); None when no rule matches."""
    hit = None
    for rule in effective_rules(cfg, folder):
        if matches(rule.rule.match, request):
            hit = rule
    return hit


# Asked when no rule matched: why the request needs a person by its own nature (e.g. an
# MCP tool whose annotations do not say read-only), naming where that comes from; None
# when it does not.
Unmatched = Callable[[], "str | None"]


def rule_for(cfg: Config, folder: str, request: Request, *,
             unmatched: Unmatched | None = None) -> Rule | None:
    """The rule that holds `request` of group `folder` for approval, or None when it may go
    ahead. A matching rule decides (`approver: none`: it goes ahead unasked); when none
    matches and people has an owner, `unmatched` may still hold it for the owner, with a
    rule named by the reason it gives."""
    hit = matching_rule(cfg, folder, request)
    if hit is None and unmatched is not None and has_owner(cfg):
        why = unmatched()
        if why is not None:
            match = ApprovalMatch(action=request.name) if request.kind == "action" else \
                ApprovalMatch(command=request.name)
            return Rule(why, ApprovalRule(match=match, approver="owner"),
                        cfg.approvals.timeout)
    return hit if hit is not None and hit.approver != "none" else None


def matches(m: ApprovalMatch, request: Request) -> bool:
    """Whether `request` is what `m` describes (see ApprovalMatch)."""
    if m.command is not None:
        pattern = COMMAND_ALIASES.get(m.command, m.command)
        if request.kind != "command" or not fnmatchcase(request.name, pattern):
            return False
        if m.to == "other_chat" and not request.other_chat:
            return False
        if m.to == "own_chat" and request.other_chat:
            return False
    elif m.action is not None:
        if request.kind != "action" or not fnmatchcase(request.name, m.action):
            return False
    else:  # pragma: no cover - the schema requires one of them
        return False
    for path, wanted in m.args.items():
        found, value = dig(request.args, path)
        if not found or not arg_matches(value, wanted):
            return False
    return True


def dig(args: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    """(True, the value) at dotted `path` in `args`; (False, None) when it is not there."""
    value: Any = args
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _same(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, str):
        return isinstance(value, str) and fnmatchcase(value, wanted)
    if isinstance(wanted, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(wanted, bool) and value is wanted
    if isinstance(wanted, int | float) and isinstance(value, int | float):
        return value == wanted
    return False


def arg_matches(value: Any, wanted: Any) -> bool:
    """An argument against a condition: any of the wanted values (strings are globs); a
    list argument matches when any of its items does."""
    wants = wanted if isinstance(wanted, tuple | list) else (wanted,)
    values = value if isinstance(value, list) else [value]
    return any(_same(v, w) for v in values for w in wants)


def rules_listing(cfg: Config, folder: str) -> list[dict[str, Any]]:
    """The effective rules of `folder` as `mdclaw approvals rules --json` shows them."""
    out = []
    for r in effective_rules(cfg, folder):
        m = r.rule.match
        out.append({"source": r.source, "command": m.command, "action": m.action,
                    "to": m.to, "args": {k: list(v) if isinstance(v, tuple) else v
                                         for k, v in m.args.items()},
                    "approver": r.approver, "timeout": int(r.timeout.total_seconds()),
                    "describe": r.describe()})
    return out
