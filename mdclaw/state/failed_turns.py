"""Failed agent turns: the messages a failed turn set aside, and the record of each failure."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from mdclaw.state.db import Database, now_iso


@dataclass(frozen=True)
class Marked:
    """The messages a failed turn set aside: how many, the first one's seq, and the times of
    the first and the last (for people to read)."""

    messages: int
    first_seq: int | None
    first_at: str | None
    last_at: str | None


def message_time(conn: sqlite3.Connection, seq: int | None) -> str | None:
    """The timestamp of the message at `seq` (None when there is none)."""
    if seq is None:
        return None
    row = conn.execute("SELECT timestamp FROM messages WHERE seq = ?", (seq,)).fetchone()
    return row[0] if row else None


def mark_messages_failed(conn: sqlite3.Connection, chat_jid: str, after: int | None,
                         upto: int, cause: str) -> Marked:
    """Mark the inbound messages of `chat_jid` after position `after` (a seq; None: from the
    start) up to `upto`, as failed with `cause` (in the caller's transaction)."""
    where = "chat_jid = ? AND seq > ? AND seq <= ? AND is_bot_message = 0"
    args = (chat_jid, after or 0, upto)
    count, first, last = conn.execute(
        f"SELECT COUNT(*), MIN(seq), MAX(seq) FROM messages WHERE {where}",  # noqa: S608
        args).fetchone()
    if count:
        conn.execute(f"UPDATE messages SET failed_cause = ? WHERE {where}",  # noqa: S608
                     (cause, *args))
    return Marked(int(count or 0), first, message_time(conn, first), message_time(conn, last))


def record_failed_turn(conn: sqlite3.Connection, *, group_folder: str, chat_jid: str | None,
                       cause: str, policy: str, outcome: str, attempts: int = 1,
                       detail: str = "", first_message_at: str | None = None,
                       last_message_at: str | None = None, messages: int = 0,
                       told: str | None = None, first_message_seq: int | None = None,
                       last_message_seq: int | None = None) -> int:
    """Record one failed turn (in the caller's transaction); return its id. The messages it
    was about are `first_message_seq`..`last_message_seq` (their times, for people, in the
    *_at fields)."""
    cur = conn.execute(
        """INSERT INTO failed_turns (group_folder, chat_jid, cause, policy, outcome, attempts,
               detail, first_message_at, last_message_at, messages, told, created_at,
               first_message_seq, last_message_seq)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (group_folder, chat_jid, cause, policy, outcome, attempts, detail[:500],
         first_message_at, last_message_at, messages, told, now_iso(), first_message_seq,
         last_message_seq))
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
