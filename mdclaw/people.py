"""Who is who: the people of the config, their identities, who may drive a group, and who
approves what.

An identity is (channel name, sender id) exactly as a channel reports an inbound message or
a button press (`InboundMessage.channel`/`.sender`): a Telegram user id, a WhatsApp jid, the
web chat's sender name. A person is the config's `people.<key>` whose identities list it.
Identities admitted through an owner's admit card are rows in the state database
(mdclaw.state.people); this module is handed a lookup for them and stays pure, so the
orchestrator, the approvals and the CLI all ask the same rules.

Who may drive a group with `members` (`verdict`): a person listed by key or by role is a
member; a person not listed is `known` (their messages are context only); an identity of no
person is `unknown` and the group's `unknown_senders` decides (ignore, ask_owner, allow),
unless it was admitted to that group. A group without `members` keeps the allow_senders rule
(mdclaw.senders) or lets everyone in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from mdclaw.config import Config, Person
from mdclaw.senders import Decision

# JID prefixes of the channels, for a stored message (which keeps only its chat).
_PREFIX_CHANNEL = {"tg": "telegram", "wa": "whatsapp", "hl": "http", "mail": "email",
                   "slack": "slack", "dc": "discord"}
_CHANNEL_LABEL = {"telegram": "Telegram", "whatsapp": "WhatsApp", "http": "web chat",
                  "email": "email", "slack": "Slack", "discord": "Discord"}
# Channels whose sender ids are the same whatever their case (an email address: the email
# channel reports it lower-cased).
_CASELESS = frozenset({"email"})


def sender_key(channel: str, sender: str) -> str:
    """A sender id as identities are compared: lower-cased on a caseless channel."""
    return sender.lower() if channel in _CASELESS else sender

Verdict = Literal["member", "known", "admitted", "unknown"]
#: admitted(channel, sender, group folder) -> whether the owner admitted that identity.
AdmittedLookup = Callable[[str, str, str], bool]


def channel_of(chat_jid: str, channel: str = "") -> str:
    """The channel name of a message: as the channel said, else from its chat's prefix."""
    if channel:
        return channel
    prefix = chat_jid.split(":", 1)[0]
    return _PREFIX_CHANNEL.get(prefix, prefix)


def identity_label(channel: str, sender: str) -> str:
    """An identity for people: "Telegram 12345", "web chat alex"."""
    return f"{_CHANNEL_LABEL.get(channel, channel)} {sender}"


@dataclass(frozen=True)
class People:
    """The people of one config, indexed by identity."""

    by_key: dict[str, Person]
    by_identity: dict[tuple[str, str], str]

    @classmethod
    def of(cls, cfg: Config) -> People:
        """The registry of `cfg` (computed once per config object)."""
        cached = _CACHE.get(id(cfg))
        if cached is not None and cached[0] is cfg:
            return cached[1]
        index = {(channel, sender_key(channel, sender)): key for key, p in cfg.people.items()
                 for channel, ids in p.identities.items() for sender in ids}
        made = cls(dict(cfg.people), index)
        _CACHE.clear()  # one config is in force at a time
        _CACHE[id(cfg)] = (cfg, made)
        return made

    def person_for(self, channel: str, sender: str) -> str | None:
        """The key of the person with identity (channel, sender), or None."""
        return self.by_identity.get((channel, sender_key(channel, sender)))

    def label(self, key: str) -> str:
        """"Alex (owner)": a person as cards and the audit name them."""
        p = self.by_key.get(key)
        return f"{p.name} ({p.role})" if p is not None else key

    def name(self, key: str) -> str:
        p = self.by_key.get(key)
        return p.name if p is not None else key

    def with_role(self, *roles: str) -> list[str]:
        return [k for k, p in self.by_key.items() if p.role in roles]

    def approvers(self, approver: str) -> list[str]:
        """The keys of the people who may decide for `approver` (owner: the owners; admin:
        admins and owners; a key: that person; none: nobody)."""
        if approver == "owner":
            return self.with_role("owner")
        if approver == "admin":
            return self.with_role("admin", "owner")
        if approver in self.by_key:
            return [approver]
        return []

    def card_chat(self, key: str) -> str | None:
        p = self.by_key.get(key)
        return p.card_chat() if p is not None else None

    def is_member(self, key: str, members: Iterable[str]) -> bool:
        p = self.by_key.get(key)
        if p is None:
            return False
        return any(m == key or m == f"role:{p.role}" for m in members)


_CACHE: dict[int, tuple[Config, People]] = {}


def verdict(cfg: Config, folder: str, channel: str, sender: str,
            admitted: AdmittedLookup) -> Verdict | None:
    """Who (channel, sender) is for group `folder`: member, known (a person who is not a
    member), admitted (an identity the owner admitted to this group) or unknown. None when
    the group has no `members` (allow_senders or everyone decides)."""
    group = cfg.groups.get(folder)
    if group is None or group.members is None:
        return None
    people = People.of(cfg)
    key = people.person_for(channel, sender)
    if key is not None:
        return "member" if people.is_member(key, group.members) else "known"
    if admitted(channel, sender, folder):
        return "admitted"
    return "unknown"


def decide(cfg: Config, folder: str, v: Verdict, *, triggered: bool) -> Decision:
    """What the orchestrator does with a message whose sender is `v` for group `folder`
    (which has members): members and admitted identities drive the agent; a known person
    who is not a member is context; an unknown sender is, by the group's unknown_senders,
    driving it (allow) or neither stored nor answered (ignore, ask_owner: the owner is
    asked, see mdclaw.decisions)."""
    if v in ("member", "admitted"):
        return Decision(store=True, direct=True, run=triggered, refused=False)
    if v == "known":
        return Decision(store=True, direct=False, run=False, refused=triggered)
    group = cfg.groups[folder]
    if group.unknown_senders == "allow":
        return Decision(store=True, direct=True, run=triggered, refused=False)
    return Decision(store=False, direct=False, run=False, refused=True)
