"""Identities admitted to a group through the owner's admit card (groups with `members` and
`unknown_senders: ask_owner`), listed by `mdclaw people list` and revoked by `mdclaw people
revoke`. The rule that reads them is mdclaw.people."""

from __future__ import annotations

import sqlite3
from dataclasses import asdict, dataclass
from typing import Any

from mdclaw.state.db import Database, now_iso


@dataclass(frozen=True)
class Admitted:
    channel: str
    sender: str
    group_folder: str
    sender_name: str | None
    admitted_by: str
    admitted_at: str
    approval_id: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def is_admitted(db: Database | sqlite3.Connection, channel: str, sender: str,
                folder: str) -> bool:
    """Whether (channel, sender) was admitted to group `folder` (a primary key seek)."""
    sql = ("SELECT 1 FROM admitted_senders WHERE channel = ? AND sender = ? AND "
           "group_folder = ?")
    args = (channel, sender, folder)
    row = (db.query_one(sql, args) if isinstance(db, Database)
           else db.execute(sql, args).fetchone())
    return row is not None


def admit(conn: sqlite3.Connection, *, channel: str, sender: str, folder: str,
          sender_name: str | None, by: str, approval_id: int | None = None) -> None:
    """Admit (channel, sender) to `folder` (in the caller's transaction); again: no change."""
    conn.execute(
        "INSERT OR IGNORE INTO admitted_senders (channel, sender, group_folder, sender_name, "
        "admitted_by, admitted_at, approval_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (channel, sender, folder, sender_name, by, now_iso(), approval_id))


def list_admitted(db: Database, folder: str | None = None) -> list[Admitted]:
    """Admitted identities (of one group, or all), oldest first."""
    sql = "SELECT * FROM admitted_senders"
    args: tuple[Any, ...] = ()
    if folder is not None:
        sql += " WHERE group_folder = ?"
        args = (folder,)
    return [Admitted(**{k: r[k] for k in Admitted.__dataclass_fields__})
            for r in db.query(sql + " ORDER BY admitted_at, channel, sender", args)]


def revoke(db: Database, *, channel: str, sender: str, folder: str | None = None) -> int:
    """Take back what (channel, sender) was admitted to (one group, or every one); returns
    how many admissions were removed."""
    with db.transaction() as c:
        if folder is None:
            return c.execute("DELETE FROM admitted_senders WHERE channel = ? AND sender = ?",
                             (channel, sender)).rowcount
        return c.execute("DELETE FROM admitted_senders WHERE channel = ? AND sender = ? AND "
                         "group_folder = ?", (channel, sender, folder)).rowcount
