"""Registered groups as `mdclaw groups list` and the operator page list them."""

from __future__ import annotations

from mdclaw.state.groups import GroupRow, Refusals

GROUP_FIELDS = ("folder", "name", "jid", "trigger", "requires_trigger", "is_main", "source")


def group_listing(g: GroupRow, refused: Refusals) -> dict[str, object]:
    """One row of `mdclaw groups list --json`: the group, its allow-list (mode and how many
    ids; null: everyone may drive it) and the messages that allow-list refused."""
    row: dict[str, object] = {k: getattr(g, k) for k in GROUP_FIELDS}
    policy = g.allow_senders
    row["allow_senders"] = ({"mode": policy.mode, "ids": len(policy.ids)}
                            if policy is not None else None)
    # Every chat it answers in (the first is `jid`), its session mode with several, and
    # where else its agent may send.
    row["chats"] = list(g.all_chats)
    row["session"] = g.session
    row["may_send_to"] = list(g.may_send_to)
    row["refused"] = refused.count
    row["last_refused_at"] = refused.last_at
    return row
