"""People and approvals: the `people` and `approvals` sections of config.yaml, the keys a
group adds to them (`members`, `unknown_senders`, `approvals`), and the rules across them
(`people_problems`, asked by mdclaw.config.schema.cross_key_problems).

A person has a name, a role and identities: per channel name (`telegram`, `whatsapp`,
`http`, and any channel added later) the sender ids that channel reports for them. What the
rules mean, and who may decide what, is mdclaw.people and mdclaw.approvals; docs/approvals.md
says it in words.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from mdclaw.config.types import CrossKeyError, Duration, Frozen, Problem, SenderId

ROLES = ("owner", "admin", "member")
Role = Literal["owner", "admin", "member"]
PERSON_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}\Z")
CHANNEL_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}\Z")
# A group's members: a person's key, or every person of a role.
MEMBER_RE = re.compile(r"^(role:(owner|admin|member)|[a-z][a-z0-9_-]{0,31})\Z")
# Who approves: the owner(s), an admin (or an owner), a named person, or nobody (a rule that
# loosens what an earlier one asked for).
APPROVER_KEYWORDS = ("owner", "admin", "none")
# The JID prefix of each channel's chats, for a person's direct chat derived from an identity.
CHANNEL_PREFIX = {"telegram": "tg", "whatsapp": "wa", "http": "hl", "email": "mail"}

# A person's key in `people` (what members, approvers and the audit name them by).
PersonKey = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
Member = Annotated[str, Field(pattern=r"^(role:(owner|admin|member)|[a-z][a-z0-9_-]{0,31})$")]


class Person(Frozen):
    name: str = Field(min_length=1, max_length=64,
                      description="How cards and the audit name this person, e.g. Alex.")
    role: Role = Field("member", description="owner: approves what the rules give the owner "
                       "(every approval by default); admin: approves what rules give an admin "
                       "(an owner may too); member: approves nothing unless a rule names them.")
    identities: dict[str, tuple[SenderId, ...]] = Field(
        default_factory=dict,
        description="Per channel name (telegram, whatsapp, http, ...), the sender ids that "
        "channel reports for this person: a Telegram user id ('123456789'), a WhatsApp jid "
        "('4915112345678@s.whatsapp.net'), the web chat's sender name. A message or a button "
        "press from one of these is this person.")
    direct_chat: str | None = Field(
        None, min_length=4, max_length=256,
        description="The chat cards for this person go to, e.g. 'tg:123456789'. Default: "
        "from the first identity (telegram id -> tg:<id>, whatsapp jid -> wa:<jid>, http "
        "name -> hl:<name>, email address -> mail:<address>).")

    @field_validator("identities")
    @classmethod
    def _channel_names(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for channel in v:
            if not CHANNEL_RE.match(channel):
                raise ValueError(f"{channel!r} is not a channel name: use the channel's name "
                                 "in lower case (telegram, whatsapp, http)")
        return v

    @model_validator(mode="after")
    def _telegram_ids(self) -> Person:
        bad = [(n, i) for n, i in enumerate(self.identities.get("telegram", ()))
               if not i.isdigit()]
        if bad:
            raise CrossKeyError([
                (("identities", "telegram", str(n)),
                 f"{i!r} is not a Telegram user id; write the number alone (e.g. '123456789'): "
                 "in a private chat with the bot, /chatid answers tg:<your user id>")
                for n, i in bad])
        return self

    def card_chat(self) -> str | None:
        """The chat this person's cards go to: `direct_chat`, else one made from the first
        identity of a channel whose chats are known (None: no such identity)."""
        if self.direct_chat:
            return self.direct_chat
        for channel, ids in self.identities.items():
            prefix = CHANNEL_PREFIX.get(channel)
            if prefix and ids:
                # the email channel's chats are mail:<address> in lower case
                return f"{prefix}:{ids[0].lower() if channel == 'email' else ids[0]}"
        return None


ArgValue = str | int | float | bool


class ApprovalMatch(Frozen):
    command: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_*?\[\]!-]+$",
        description="IPC command types, as a glob: message (send_message), send_file, react, "
        "schedule_task, update_task, pause_task, resume_task, cancel_task, delete_task, "
        "register_group, unregister_group, refresh_groups.")
    action: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.*?\[\]!-]+$",
        description="Action names, as a glob: ha_call_service, ha_*, web_fetch, ask_person...")
    to: Literal["own_chat", "other_chat"] | None = Field(
        None, description="For commands that name a chat (message, send_file, react, "
        "schedule_task): only the group's own chat, or only another chat.")
    args: dict[str, ArgValue | tuple[ArgValue, ...]] = Field(
        default_factory=dict,
        description="Argument conditions: a parameter (a dotted path into objects, e.g. "
        "target.entity_id) and the values it may have for the rule to match (a list: any of "
        "them; strings are globs, e.g. 'lock.*'). A list argument matches when any of its "
        "items does.")

    @model_validator(mode="after")
    def _one_kind(self) -> ApprovalMatch:
        if (self.command is None) == (self.action is None):
            raise CrossKeyError([((), "give exactly one of command, action")])
        if self.to is not None and self.command is None:
            raise CrossKeyError([(("to",), "`to` is for commands (message, send_file, react, "
                                           "schedule_task); remove it or match a command")])
        return self


class ApprovalRule(Frozen):
    match: ApprovalMatch = Field(description="What this rule is about.")
    approver: str = Field(
        "owner", min_length=1, max_length=32,
        description="Who approves: owner, admin (an admin or an owner), a person's key, or "
        "none (no approval: loosens an earlier rule).")
    timeout: Duration | None = Field(
        None, description="No answer within this long is a denial (default: "
        "approvals.timeout).")

    @field_validator("approver")
    @classmethod
    def _approver(cls, v: str) -> str:
        if v not in APPROVER_KEYWORDS and not PERSON_RE.match(v):
            raise ValueError(f"{v!r} is not owner, admin, none or a person's key")
        return v


class Approvals(Frozen):
    defaults: bool = Field(
        True, description="The built-in rules (docs/approvals.md): Home Assistant writes, "
        "dashboard applies, restarts, group registration and sending to another chat need "
        "the owner. false: none of them. They apply once people has an owner.")
    timeout: Duration = Field(
        timedelta(minutes=30),
        description="No answer within this long is a denial (per rule: its timeout).")
    rules: tuple[ApprovalRule, ...] = Field(
        (), description="Rules for every group, after the defaults; a later matching rule "
        "wins (groups.<g>.approvals come last).")


def people_problems(people: Mapping[str, Person], approvals: Approvals,
                    groups: Mapping[str, Any]) -> list[tuple[Problem, tuple[tuple[str, ...], ...]]]:
    """What is wrong across `people`, `approvals` and the groups (schema_groups.Group: their
    members, unknown_senders and approvals): each problem at its key with the fix, and the
    entries it depends on."""
    out: list[tuple[Problem, tuple[tuple[str, ...], ...]]] = []

    def add(path: tuple[str, ...], msg: str, *needs: tuple[str, ...]) -> None:
        out.append(((path, msg), needs))

    claimed: dict[tuple[str, str], str] = {}
    for key, p in people.items():
        for channel, ids in p.identities.items():
            for n, sender in enumerate(ids):
                other = claimed.setdefault((channel, sender), key)
                if other != key:
                    add(("people", key, "identities", channel, str(n)),
                        f"{channel} {sender!r} is also an identity of {other!r}: an identity "
                        "is one person's; remove it from one of them")
    owners = [k for k, p in people.items() if p.role == "owner"]
    admins = [k for k, p in people.items() if p.role in ("owner", "admin")]

    def check_approver(path: tuple[str, ...], approver: str) -> None:
        if approver == "none":
            return
        if approver == "owner" and not owners:
            add(path, "this rule is approved by the owner, but no person has role: owner; "
                "give one person in people role: owner", ("people",))
        elif approver == "admin" and not admins:
            add(path, "this rule is approved by an admin, but no person has role admin or "
                "owner; give one person in people role: owner", ("people",))
        elif approver not in APPROVER_KEYWORDS and approver not in people:
            known = ", ".join(sorted(people)) or "none"
            add(path, f"{approver!r} is not a person in people (known: {known}); name one "
                "of them, or owner/admin", ("people", approver))

    if people and approvals.defaults and not owners:
        add(("people",), "the approval defaults need an owner, but no person has role: owner: "
            "give one person role: owner (or set approvals.defaults: false)")
    for n, rule in enumerate(approvals.rules):
        check_approver(("approvals", "rules", str(n), "approver"), rule.approver)
    for folder, g in groups.items():
        for n, rule in enumerate(g.approvals):
            check_approver(("groups", folder, "approvals", str(n), "approver"), rule.approver)
        if g.members is not None and g.allow_senders is not None:
            add(("groups", folder, "allow_senders"),
                "allow_senders and members are both set: members (people and roles, with "
                "unknown_senders for everyone else) replaces allow_senders; keep members and "
                "remove allow_senders (docs/configuration.md: 'Who may drive an agent')")
        if g.unknown_senders != "ignore" and g.members is None:
            add(("groups", folder, "unknown_senders"),
                "unknown_senders is about senders who are not members, but members is not "
                "set (everyone may drive the group): add members, or remove unknown_senders")
        for n, m in enumerate(g.members or ()):
            if not m.startswith("role:") and m not in people:
                known = ", ".join(sorted(people)) or "none"
                add(("groups", folder, "members", str(n)),
                    f"{m!r} is not a person in people (known: {known}) nor a role "
                    "(role:owner, role:admin, role:member): name one of them or add the "
                    "person under people", ("people", m))
        if g.unknown_senders == "ask_owner" and not owners:
            add(("groups", folder, "unknown_senders"),
                "ask_owner sends the owner an admit card, but no person has role: owner: "
                "give one person role: owner", ("people",))
    return out


def rule_dict(rule: ApprovalRule) -> dict[str, Any]:
    """A rule as config.yaml writes it (for `mdclaw approvals rules`)."""
    return rule.model_dump(mode="json", exclude_none=True, exclude_defaults=True) | {
        "approver": rule.approver}
