"""Chats the channels know (the `chats` table), for the group snapshot main's agent reads."""

from __future__ import annotations

from typing import Any

from mdclaw.state.db import Database


def list_chats(db: Database) -> list[dict[str, Any]]:
    """Every known chat as {jid, name, last_activity, channel, is_group}, newest first."""
    rows = db.query("SELECT jid, name, last_activity, channel, is_group FROM chats "
                    "ORDER BY last_activity DESC, jid")
    return [dict(r) for r in rows]
