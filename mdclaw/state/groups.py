"""Registered groups: the folder, chat, trigger and sender allow-list of every group the host
serves, and how many messages each group's allow-list refused."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mdclaw.senders import SenderPolicy
from mdclaw.state.db import Database, now_iso


@dataclass(frozen=True)
class GroupRow:
    folder: str
    name: str
    jid: str | None
    trigger: str
    requires_trigger: bool
    is_main: bool
    source: str  # 'config' or 'ipc'
    added_at: str = ""
    updated_at: str | None = None
    container_config: dict[str, Any] = field(default_factory=dict)
    allow_senders: SenderPolicy | None = None  # None: everyone in the chat may drive it
    # Every chat of the group, the first (`jid`) first; () for a row made with `jid` alone.
    chats: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def all_chats(self) -> tuple[str, ...]:
        """Every chat the group answers in, its first (`jid`) first; () without a chat."""
        if self.chats:
            return self.chats
        return (self.jid,) if self.jid else ()

    @property
    def session(self) -> str:
        """`shared` (one conversation over all its chats) or `per_chat`."""
        return "per_chat" if self.container_config.get("session") == "per_chat" else "shared"

    @property
    def per_chat(self) -> bool:
        """Each chat has a conversation of its own (several chats, `session: per_chat`)."""
        return self.session == "per_chat" and len(self.all_chats) > 1

    @property
    def may_send_to(self) -> tuple[str, ...]:
        """Chats and group folders the agent may send to besides its own chats."""
        return tuple(str(d) for d in self.container_config.get("may_send_to") or ())

    def line(self, chat: str | None) -> tuple[str, ...]:
        """The chats a conversation of the group reads: `chat`'s alone in a per_chat group
        (chat given), else every chat of the group."""
        if chat is not None and self.per_chat and chat in self.all_chats:
            return (chat,)
        return self.all_chats

    def lines(self) -> list[str | None]:
        """The group's conversations: one per chat (per_chat), else the one (None)."""
        return list(self.all_chats) if self.per_chat else [None]


_SELECT = """SELECT g.*, (SELECT json_group_array(jid) FROM (SELECT jid FROM group_chats c
    WHERE c.folder = g.folder ORDER BY c.ord, c.jid)) AS chat_list FROM registered_groups g"""


def _chats(raw: str | None, jid: str | None) -> tuple[str, ...]:
    chats = tuple(str(c) for c in json.loads(raw)) if raw else ()
    if jid and (not chats or chats[0] != jid):
        chats = (jid, *(c for c in chats if c != jid))
    return chats


def _row(r: Any) -> GroupRow:
    cc = r["container_config"]
    return GroupRow(
        folder=r["folder"], name=r["name"], jid=r["jid"], trigger=r["trigger"],
        requires_trigger=bool(r["requires_trigger"]), is_main=bool(r["is_main"]),
        source=r["source"], added_at=r["added_at"], updated_at=r["updated_at"],
        container_config=json.loads(cc) if cc else {},
        allow_senders=SenderPolicy.from_json(r["allow_senders"]),
        chats=_chats(r["chat_list"], r["jid"]),
    )


def list_groups(db: Database) -> list[GroupRow]:
    return [_row(r) for r in db.query(f"{_SELECT} ORDER BY g.folder")]


def get_group(db: Database, folder: str) -> GroupRow | None:
    r = db.query_one(f"{_SELECT} WHERE g.folder = ?", (folder,))
    return _row(r) if r else None


def get_group_by_jid(db: Database, jid: str) -> GroupRow | None:
    """The group that answers in chat `jid` (any of its chats), or None."""
    r = db.query_one(f"{_SELECT} WHERE g.folder = (SELECT folder FROM group_chats "  # noqa: S608
                     "WHERE jid = ?)", (jid,))
    return _row(r) if r else None


def chat_owner(conn: Any, jid: str) -> str | None:
    """The folder of the group that answers in chat `jid`, or None (in a transaction)."""
    r = conn.execute("SELECT folder FROM group_chats WHERE jid = ?", (jid,)).fetchone()
    return str(r[0]) if r else None


def main_group(db: Database) -> GroupRow | None:
    r = db.query_one(f"{_SELECT} WHERE g.is_main = 1")
    return _row(r) if r else None


def upsert_group(db: Database, g: GroupRow) -> None:
    """Insert or update the group `g.folder` (keeps its original added_at)."""
    now = now_iso()
    with db.transaction() as c:
        c.execute(
            """INSERT INTO registered_groups (folder, name, jid, trigger, added_at,
                   container_config, requires_trigger, is_main, source, updated_at,
                   allow_senders)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT(folder) DO UPDATE SET name=excluded.name, jid=excluded.jid,
                   trigger=excluded.trigger, container_config=excluded.container_config,
                   requires_trigger=excluded.requires_trigger, is_main=excluded.is_main,
                   source=excluded.source, updated_at=excluded.updated_at,
                   allow_senders=excluded.allow_senders""",
            (g.folder, g.name, g.jid, g.trigger, g.added_at or now,
             json.dumps(g.container_config, sort_keys=True) if g.container_config else None,
             int(g.requires_trigger), int(g.is_main), g.source, now,
             g.allow_senders.to_json() if g.allow_senders else None),
        )
        c.execute("DELETE FROM group_chats WHERE folder = ?", (g.folder,))
        # A chat moving between groups of the config: the group written last holds it.
        c.executemany("INSERT OR REPLACE INTO group_chats (jid, folder, ord) VALUES (?, ?, ?)",
                      [(jid, g.folder, n) for n, jid in enumerate(g.all_chats)])


def delete_group(db: Database, folder: str) -> bool:
    """Deregister `folder` (its files stay on disk). True if a row was removed."""
    with db.transaction() as c:
        c.execute("DELETE FROM group_chats WHERE folder = ?", (folder,))
        return c.execute("DELETE FROM registered_groups WHERE folder = ?", (folder,)).rowcount > 0


@dataclass(frozen=True)
class Refusals:
    """Messages a group's allow_senders refused: how many, and when the latest came."""

    count: int = 0
    last_at: str | None = None


def count_refusal(db: Database, folder: str, at: str | None = None) -> None:
    """Count one refused message for `folder` at `at` (default: now)."""
    with db.transaction() as c:
        c.execute(
            """INSERT INTO sender_refusals (group_folder, refused, last_refused_at)
               VALUES (?, 1, ?) ON CONFLICT(group_folder) DO UPDATE SET
                   refused = refused + 1, last_refused_at = excluded.last_refused_at""",
            (folder, at or now_iso()))


def refusals(db: Database) -> dict[str, Refusals]:
    """Refused message counts by group folder; a folder without any is absent."""
    return {r["group_folder"]: Refusals(r["refused"], r["last_refused_at"])
            for r in db.query("SELECT * FROM sender_refusals")}
