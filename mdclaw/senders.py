"""Who may drive a group's agent: the one rule, for every channel.

A group may carry an allow-list of sender ids (`allow_senders` in config.yaml). Without one,
everyone in the chat may drive the agent. With one, a message from a sender not on the list
is, by the list's mode:

- `trigger`: stored and shown to the agent as context with the next turn an allowed sender
  starts, but it never starts a turn, nor is it fed into a running conversation on its own;
- `drop`: not stored at all.

Either way it is counted as refused (in `trigger` mode only when it would have started a turn)
and never answered. The orchestrator asks `decide` for every inbound and stored message, so
no channel and no code path has a rule of its own.

This module is pure and imports nothing of mdclaw: the config, the state layer and the
orchestrator all use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Mode = Literal["trigger", "drop"]
#: The sender of notes the host itself puts into a group's conversation (an approval's
#: outcome): context for the agent's next turn, never a turn of their own. No channel
#: reports it: channel senders are user ids, jids and names without this prefix.
HOST_SENDER = "mdclaw:host"
MODES: tuple[Mode, ...] = ("trigger", "drop")


@dataclass(frozen=True)
class SenderPolicy:
    """A group's allow-list: the sender ids that may drive its agent, and what happens to
    messages from everyone else (`mode`)."""

    mode: Mode
    ids: frozenset[str]

    def as_dict(self) -> dict[str, Any]:
        """{"mode", "ids"} with the ids sorted: the stored and the displayed form."""
        return {"mode": self.mode, "ids": sorted(self.ids)}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> SenderPolicy | None:
        """The policy stored as `text` (see to_json); None for no text (everyone may).

        Raises ValueError if `text` is not a stored policy.
        """
        if not text:
            return None
        data = json.loads(text)
        mode, ids = data.get("mode"), data.get("ids")
        if mode not in MODES or not isinstance(ids, list):
            raise ValueError(f"not a stored allow_senders policy: {text[:200]!r}")
        return cls(mode=mode, ids=frozenset(str(i) for i in ids))


@dataclass(frozen=True)
class Decision:
    """What the orchestrator does with one message of a registered group."""

    store: bool  # keep it in the database (as context at least)
    direct: bool  # from an allowed sender: it may be fed into a running conversation
    run: bool  # it starts a turn, or joins the running one
    refused: bool  # count it against the group's refused messages


#: What becomes of a host note: kept as context, never a turn, never counted.
HOST_NOTE = Decision(store=True, direct=False, run=False, refused=False)


def decide(policy: SenderPolicy | None, sender: str, *, triggered: bool) -> Decision:
    """The decision for a message from `sender` in a group with `policy` (None: everyone
    may); `triggered` says whether the message is for the assistant by the group's trigger
    rules (main group, no trigger required, trigger mentioned, bot addressed)."""
    if policy is None or sender in policy.ids:
        return Decision(store=True, direct=True, run=triggered, refused=False)
    if policy.mode == "drop":
        return Decision(store=False, direct=False, run=False, refused=True)
    return Decision(store=True, direct=False, run=False, refused=triggered)


def jid_is_group_chat(jid: str) -> bool | None:
    """Whether the chat `jid` has more members than the bot and one person, judged from its
    shape alone: True or False where the shape tells, None where it does not.

    Telegram chat ids of groups, supergroups and channels are negative; those of private
    chats are positive. A mail chat (`mail:<address>`) is one person's. The local HTTP
    channel's chats say nothing either way.
    """
    prefix, _, rest = jid.partition(":")
    if prefix == "tg" and rest.lstrip("-").isdigit():
        return rest.startswith("-")
    if prefix == "mail" and "@" in rest:
        return False
    return None


def main_group_warning(folder: str, jid: str, *, group_chat: bool | None,
                       policy_set: bool, source: str = "") -> str | None:
    """The warning for a main group (admin powers) that every member of a group chat may
    drive; None when there is nothing to warn about. `source` says how `group_chat` is
    known (e.g. "the chats table"), for the message."""
    if policy_set or not group_chat:
        return None
    how = f" ({source})" if source else ""
    return (f"groups.{folder}: the main group answers in {jid}, a group chat{how}, and has no "
            "allow_senders: every member of that chat can drive the agent with the main "
            "group's admin powers; add allow_senders: {mode: trigger, ids: [\"<your user "
            "id>\"]} to the group, or make a private chat the main group")
