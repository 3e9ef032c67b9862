"""Chat messages, per-group cursors and agent sessions.

Inbound messages are stored once (a message id is unique: it is the channel's id, which
channels make unique by prefixing it with the chat). Each stored message gets the host's
sequence number, `seq`, when it is stored: a chat's messages are in the order of their seq,
never of the chat service's clock (whole seconds for Telegram and WhatsApp, and a phone's
clock may step). A group's cursor is the seq of the newest message of its chat whose turn is
done; it moves only when a run succeeded or its output was delivered, so a failed run is
retried with the same messages. Every message stored after the cursor moved has a higher
seq, so none can fall behind it.

A message whose files are still being downloaded is stored at once with `files_pending`
set (so a redelivery is a duplicate, and a restart finds it), but it and every later message
of its chat stay out of `messages_since` until `settle_files` fills in what became of its
files: the agent reads a chat's messages in order, never a message before the file sent
ahead of it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mdclaw.state.db import Database, now_iso
from mdclaw.state.groups import get_group


@dataclass(frozen=True)
class StoredMessage:
    id: str
    chat_jid: str
    sender: str
    sender_name: str
    content: str
    timestamp: str
    is_from_me: bool
    is_bot_message: bool
    #: What became of each file that came with the message (see mdclaw.media.Saved.as_dict).
    attachments: tuple[Mapping[str, Any], ...] = ()
    files_pending: bool = False
    #: The host's sequence number, given when the message is stored (0: not stored yet).
    seq: int = 0


def upsert_chat(conn: sqlite3.Connection, jid: str, name: str | None, channel: str,
                is_group: bool, last_activity: str | None = None) -> None:
    conn.execute(
        """INSERT INTO chats (jid, name, last_activity, channel, is_group) VALUES (?, ?, ?, ?, ?)
           ON CONFLICT(jid) DO UPDATE SET name = COALESCE(excluded.name, chats.name),
               last_activity = MAX(chats.last_activity, excluded.last_activity),
               channel = excluded.channel, is_group = excluded.is_group""",
        (jid, name, last_activity or now_iso(), channel, int(is_group)),
    )


def store_message(db: Database, m: StoredMessage, *, chat_name: str | None = None,
                  channel: str = "unknown", is_group: bool = False) -> bool:
    """Store an inbound message (and its chat). False if that id was already stored."""
    with db.transaction() as c:
        upsert_chat(c, m.chat_jid, chat_name, channel, is_group, m.timestamp)
        cur = c.execute(
            """INSERT OR IGNORE INTO messages (id, chat_jid, sender, sender_name, content,
                   timestamp, is_from_me, is_bot_message, attachments, files_pending)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (m.id, m.chat_jid, m.sender, m.sender_name, m.content, m.timestamp,
             int(m.is_from_me), int(m.is_bot_message), _dump_attachments(m.attachments),
             int(m.files_pending)),
        )
        return cur.rowcount > 0


def _dump_attachments(attachments: Sequence[Mapping[str, Any]]) -> str | None:
    return json.dumps([dict(a) for a in attachments]) if attachments else None


def _load_attachments(raw: str | None) -> tuple[Mapping[str, Any], ...]:
    if not raw:
        return ()
    try:
        value = json.loads(raw)
    except ValueError:
        return ()
    return tuple(a for a in value if isinstance(a, dict)) if isinstance(value, list) else ()


def settle_files(db: Database, message_id: str,
                 attachments: Sequence[Mapping[str, Any]]) -> None:
    """Record what became of a pending message's files and release it (and the messages of
    its chat behind it) to the agent."""
    with db.transaction() as c:
        c.execute("UPDATE messages SET attachments = ?, files_pending = 0 WHERE id = ?",
                  (_dump_attachments(attachments), message_id))


def pending_files(db: Database) -> list[StoredMessage]:
    """Messages whose files were still being downloaded (e.g. when mdclaw stopped)."""
    return [_row(r) for r in db.query(
        "SELECT * FROM messages WHERE files_pending = 1 ORDER BY seq")]


def _row(r: sqlite3.Row) -> StoredMessage:
    return StoredMessage(r["id"], r["chat_jid"], r["sender"], r["sender_name"], r["content"],
                         r["timestamp"], bool(r["is_from_me"]), bool(r["is_bot_message"]),
                         _load_attachments(r["attachments"]), bool(r["files_pending"]),
                         int(r["seq"]))


# The newest `limit` messages of a chat after the cursor, newest first: a range seek in
# idx_messages_chat_jid (chat_jid, seq), read backwards; the first message whose files are
# pending is a seek in idx_messages_files_pending. tests/test_query_plans.py holds both.
MESSAGES_SINCE_SQL = """\
SELECT * FROM messages WHERE chat_jid = :chat AND seq > :after AND is_bot_message = 0
  AND seq < COALESCE((SELECT MIN(seq) FROM messages WHERE chat_jid = :chat
                      AND files_pending = 1), 9223372036854775807)
ORDER BY seq DESC LIMIT :limit"""


def messages_since(db: Database, chat_jid: str, after: int | None,
                   limit: int = 200) -> list[StoredMessage]:
    """Inbound (non-bot) messages of `chat_jid` after position `after` (a seq; None: from
    the start), oldest first; the newest `limit` when there are more. Messages from the
    oldest one whose files are still being downloaded on are left out (see the module's
    notes)."""
    rows = db.query(MESSAGES_SINCE_SQL, {"chat": chat_jid, "after": after or 0, "limit": limit})
    return [_row(r) for r in reversed(rows)]


def line_messages(db: Database, chats: Sequence[str], after: int | None,
                  limit: int = 200) -> list[StoredMessage]:
    """`messages_since` over every chat of `chats` (a group's conversation that reads several
    chats): merged in the order of their seq (one order across chats, the host's), the newest
    `limit`. Each chat is its own seek in idx_messages_chat_jid."""
    if len(chats) == 1:
        return messages_since(db, chats[0], after, limit)
    merged = sorted((m for chat in chats for m in messages_since(db, chat, after, limit)),
                    key=lambda m: m.seq)
    return merged[-limit:] if limit else merged


def _get_state(db: Database, key: str) -> str | None:
    r = db.query_one("SELECT value FROM router_state WHERE key = ?", (key,))
    return r[0] if r else None


def _set_state(db: Database, key: str, value: str | None) -> None:
    with db.transaction() as c:
        if value is None:
            c.execute("DELETE FROM router_state WHERE key = ?", (key,))
        else:
            c.execute("INSERT INTO router_state (key, value) VALUES (?, ?) ON CONFLICT(key) "
                      "DO UPDATE SET value = excluded.value", (key, value))


def get_router_value(db: Database, key: str) -> str | None:
    """A value of router_state (a channel's own bookkeeping, e.g. Telegram's offset)."""
    return _get_state(db, key)


def set_router_value(db: Database, key: str, value: str | None) -> None:
    """Set (None: remove) a value of router_state."""
    _set_state(db, key, value)


def _cursor_key(folder: str, chat: str | None = None) -> str:
    return f"agent_cursor:{folder}" if chat is None else f"agent_cursor:{folder}@{chat}"


def get_cursor(db: Database, folder: str, chat: str | None = None) -> int | None:
    """The group's cursor: the seq of the newest message whose turn is done (None: no
    turn has been done yet). `chat`: the cursor of that chat's own conversation (a group
    with `session: per_chat`); a chat without one yet reads the group's."""
    value = _get_state(db, _cursor_key(folder, chat))
    if value is None and chat is not None:
        value = _get_state(db, _cursor_key(folder))
    return int(value) if value is not None else None


def set_cursor(db: Database, folder: str, seq: int | None, chat: str | None = None) -> None:
    """Move the group's cursor (`chat`: that chat's conversation's) to `seq` (None: back to
    before the first message)."""
    _set_state(db, _cursor_key(folder, chat), None if seq is None else str(int(seq)))


def move_cursor(db: Database, folder: str, seq: int | None, line: str | None = None) -> None:
    """A conversation's turn is done (or set aside, or rolled back): move the cursor of
    conversation `line` (a per_chat group's chat; None: the group's one) to `seq`, and carry
    it to the conversations the group has now. A reload may have switched the group's
    `session` while this conversation ran: the reconciler gave the new mode's cursors where
    this one stood then (mdclaw.reconcile.align_cursors), and what this conversation answered
    since must not be answered again by them. A shared conversation's `seq` covers every
    chat's messages up to it (each chat's own cursor moves up to it); a chat's own
    conversation's covers its chat's, and the shared cursor, which a switch back starts after
    the furthest chat, moves up to it. Cursors only move forward this way."""
    with db.transaction():
        set_cursor(db, folder, seq, line)
        if seq is None:
            return
        group = get_group(db, folder)
        if group is None:
            return
        if line is None and group.per_chat:
            for chat in group.all_chats:
                own = _get_state(db, _cursor_key(folder, chat))
                if own is None or int(own) < seq:
                    set_cursor(db, folder, seq, chat)
        elif line is not None and not group.per_chat:
            shared = _get_state(db, _cursor_key(folder))
            if shared is None or int(shared) < seq:
                set_cursor(db, folder, seq)


def has_own_cursor(db: Database, folder: str, chat: str) -> bool:
    """`chat`'s conversation has a cursor of its own (not the group's)."""
    return _get_state(db, _cursor_key(folder, chat)) is not None


def newest_seq(db: Database, chat: str) -> int:
    """The seq of the newest message stored in `chat` (0: none)."""
    r = db.query_one("SELECT MAX(seq) FROM messages WHERE chat_jid = ?", (chat,))
    return int(r[0]) if r and r[0] is not None else 0


def session_key(folder: str, chat: str | None = None) -> str:
    """Where a conversation's session id is kept: the group's folder, or `folder@chat` for
    one chat's own conversation (`session: per_chat`)."""
    return folder if chat is None else f"{folder}@{chat}"


def get_session(db: Database, folder: str, chat: str | None = None) -> str | None:
    r = db.query_one("SELECT session_id FROM sessions WHERE group_folder = ?",
                     (session_key(folder, chat),))
    return r[0] if r else None


def set_session(db: Database, folder: str, session_id: str | None,
                chat: str | None = None) -> None:
    key = session_key(folder, chat)
    with db.transaction() as c:
        if session_id:
            c.execute("INSERT INTO sessions (group_folder, session_id) VALUES (?, ?) "
                      "ON CONFLICT(group_folder) DO UPDATE SET session_id = excluded.session_id",
                      (key, session_id))
        else:
            c.execute("DELETE FROM sessions WHERE group_folder = ?", (key,))
