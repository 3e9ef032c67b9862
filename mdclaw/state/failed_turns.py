"""Failed agent turns: the messages a failed turn set aside, and the record of each failure."""

from __future__ import annotations

import sqlite3
from typing import Any

from mdclaw.state.db import Database, now_iso


def mark_messages_failed(conn: sqlite3.Connection, chat_jid: str, after: str | None,
                         upto: str, cause: str) -> tuple[int, str | None]:
    """Mark the inbound messages of `chat_jid` newer than `after`, up to `upto`, as failed
    with `cause` (in the caller's transaction); return (how many, the oldest's timestamp)."""
    row = conn.execute(
        "SELECT COUNT(*), MIN(timestamp) FROM messages WHERE chat_jid = ? AND timestamp > ? "
        "AND timestamp <= ? AND is_bot_message = 0", (chat_jid, after or "", upto)).fetchone()
    conn.execute(
        "UPDATE messages SET failed_cause = ? WHERE chat_jid = ? AND timestamp > ? "
        "AND timestamp <= ? AND is_bot_message = 0", (cause, chat_jid, after or "", upto))
    return int(row[0] or 0), row[1]


def record_failed_turn(conn: sqlite3.Connection, *, group_folder: str, chat_jid: str | None,
                       cause: str, policy: str, outcome: str, attempts: int = 1,
                       detail: str = "", first_message_at: str | None = None,
                       last_message_at: str | None = None, messages: int = 0,
                       told: str | None = None) -> int:
    cur = conn.execute(
        """INSERT INTO failed_turns (group_folder, chat_jid, cause, policy, outcome, attempts,
               detail, first_message_at, last_message_at, messages, told, created_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (group_folder, chat_jid, cause, policy, outcome, attempts, detail[:500],
         first_message_at, last_message_at, messages, told, now_iso()))
    return int(cur.lastrowid or 0)


def list_failed_turns(db: Database, *, group: str | None = None, since: str | None = None,
                      limit: int = 50) -> list[dict[str, Any]]:
    """Failed turns, newest first."""
    where, params = [], []
    if group:
        where.append("group_folder = ?")
        params.append(group)
    if since:
        where.append("created_at >= ?")
        params.append(since)
    # Fixed column names only; every value is a parameter.
    sql = ("SELECT * FROM failed_turns" + (" WHERE " + " AND ".join(where)  # noqa: S608
                                           if where else "") + " ORDER BY id DESC LIMIT ?")
    return [dict(r) for r in db.query(sql, (*params, limit))]


def failures_per_group(db: Database, since: str) -> dict[str, int]:
    """How many failed turns each group had since `since` (ISO UTC)."""
    rows = db.query("SELECT group_folder, COUNT(*) FROM failed_turns WHERE created_at >= ? "
                    "GROUP BY group_folder", (since,))
    return {r[0]: int(r[1]) for r in rows}
