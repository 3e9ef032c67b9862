"""The durable outbox: every outbound message, file and reaction, until delivered or failed."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from mdclaw.errors import StateError
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state.db import Database, now_iso

OUTBOX_KINDS = ("text", "file", "reaction")


@dataclass(frozen=True)
class OutboxRow:
    id: int
    chat_jid: str
    kind: str
    text: str | None
    file_path: str | None
    file_name: str | None
    message_id: str | None
    emoji: str | None
    reply_to: str | None
    sender: str | None
    source_group: str | None
    status: str
    attempts: int
    next_attempt_at: str | None
    last_error: str | None
    created_at: str
    updated_at: str
    sent_at: str | None
    source_path: str | None = None  # set while the host copy of a sent file is being made
    card: str | None = None  # a card (JSON: text, choices), sent with the channel's buttons

    @property
    def waiting_for_copy(self) -> bool:
        return self.source_path is not None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = tuple(f.name for f in fields(OutboxRow))
# Positions of OutboxRow's fields among a query's columns, by the query's column names.
_POSITIONS: dict[tuple[str, ...], tuple[int, ...]] = {}


def outbox_rows(rows: Sequence[sqlite3.Row]) -> list[OutboxRow]:
    """`rows` of the outbox (`SELECT *`, maybe with more columns after) as OutboxRow.

    The fields are found among the columns by name once for the whole list, then each row
    is taken by position: a look-up by name per field and row cost about as much again
    as the query that read it (20 fields: 9 µs a row against 3.5)."""
    if not rows:
        return []
    keys = tuple(rows[0].keys())
    pos = _POSITIONS.get(keys)
    if pos is None:
        missing = [f for f in _FIELDS if f not in keys]
        if missing:
            raise ValueError(f"outbox query lacks the column(s) {', '.join(missing)}")
        pos = _POSITIONS[keys] = tuple(keys.index(f) for f in _FIELDS)
    n = len(_FIELDS)
    if pos == tuple(range(n)):  # `SELECT *`: the table's columns in the fields' order
        return [OutboxRow(*r[:n]) for r in rows]
    return [OutboxRow(*[r[i] for i in pos]) for r in rows]


def outbox_row(r: sqlite3.Row) -> OutboxRow:
    """One row of the outbox as OutboxRow (see outbox_rows)."""
    return outbox_rows([r])[0]


def enqueue(conn: sqlite3.Connection, *, chat_jid: str, kind: str, text: str | None = None,
            file_path: str | None = None, file_name: str | None = None,
            message_id: str | None = None, emoji: str | None = None,
            reply_to: str | None = None, sender: str | None = None,
            source_group: str | None = None, source_path: str | None = None,
            card: str | None = None, claimed: bool = False, sent: bool = False,
            now: str | None = None) -> int:
    """Add a pending row (in the caller's transaction) and return its id. A file row with
    `source_path` waits until the host copy is made (see `mdclaw.ipc.spool`). A card row
    (`card`: JSON text, choices; `text` None) is sent with the channel's buttons, or edits
    the message `message_id` when that is given (mdclaw.approvals.flow). `claimed`: the row
    is written already claimed by the outbox worker (`sending`, its first try counted), for
    a worker that is handed it after COMMIT (OutboxWorker.hand_off); a crash before it is
    sent leaves it `sending`, which the worker's recover() puts back to pending. `sent`:
    the row is written delivered already, its first try counted (a text whose channel wrote
    it to the chat page in this same transaction: OutboxWorker.write_locally)."""
    if kind not in OUTBOX_KINDS:
        raise ValueError(f"unknown outbox kind {kind!r}")
    now = now or now_iso()
    status = "sent" if sent else "sending" if claimed else "pending"
    cur = conn.execute(
        """INSERT INTO outbox (chat_jid, kind, text, file_path, file_name, message_id, emoji,
               reply_to, sender, source_group, status, attempts, next_attempt_at, created_at,
               updated_at, sent_at, source_path, card)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (chat_jid, kind, text, file_path, file_name, message_id, emoji, reply_to, sender,
         source_group, status, 1 if sent or claimed else 0, None if sent else now, now,
         now, now if sent else None, source_path, card),
    )
    return int(cur.lastrowid or 0)


def has_open_rows(conn: sqlite3.Connection, chat_jid: str) -> bool:
    """True if the chat has a row not yet sent or failed (a seek in idx_outbox_open)."""
    return conn.execute(
        "SELECT 1 FROM outbox WHERE chat_jid = ? AND status IN ('pending', 'sending') LIMIT 1",
        (chat_jid,)).fetchone() is not None


def list_outbox(db: Database, status: str | None = None, limit: int = 1000) -> list[OutboxRow]:
    sql = "SELECT * FROM outbox"
    params: tuple[Any, ...] = ()
    if status:
        sql += " WHERE status = ?"
        params = (status,)
    sql += " ORDER BY id DESC LIMIT ?"
    return outbox_rows(db.query(sql, (*params, limit)))


class OutboxError(StateError, ValueError):
    """An operator's change to an outbox row that cannot be made (no such row, not failed).
    The message is safe to show."""


def _failed_row(conn: sqlite3.Connection, row_id: int) -> sqlite3.Row:
    r = conn.execute("SELECT * FROM outbox WHERE id = ?", (row_id,)).fetchone()
    if r is None:
        raise OutboxError(f"no outbox row with id {row_id}")
    if r["status"] != "failed":
        raise OutboxError(f"outbox row {row_id} is {r['status']}, not failed: only failed "
                          "rows can be retried or dropped")
    return r


def retry_failed(conn: sqlite3.Connection, row_id: int) -> OutboxRow:
    """Give a failed row a fresh set of tries, due now (in the caller's transaction); the
    running daemon's outbox worker sends it at its next look. Raises OutboxError."""
    _failed_row(conn, row_id)
    now = now_iso()
    conn.execute("UPDATE outbox SET status = 'pending', attempts = 0, next_attempt_at = ?, "
                 "updated_at = ? WHERE id = ?", (now, now, row_id))
    return outbox_row(conn.execute("SELECT * FROM outbox WHERE id = ?", (row_id,)).fetchone())


def drop_failed(conn: sqlite3.Connection, row_id: int) -> OutboxRow:
    """Remove a failed row for good (in the caller's transaction); returns what it was.
    Raises OutboxError."""
    r = _failed_row(conn, row_id)
    conn.execute("DELETE FROM outbox WHERE id = ?", (row_id,))
    return outbox_row(r)


def outbox_counts(db: Database) -> dict[str, int]:
    """Number of rows per status (every status present, zero when none). Counts every row
    ever sent: for a one-off look (`mdclaw status`); what the daemon looks at every few
    seconds is `recent_outbox_counts`."""
    counts = {s: 0 for s in ("pending", "sending", "sent", "failed")}
    for r in db.query("SELECT status, COUNT(*) FROM outbox GROUP BY status"):
        counts[r[0]] = int(r[1])
    return counts


SENT_WINDOW = timedelta(days=1)


def recent_outbox_counts(db: Database, now: datetime | None = None) -> dict[str, int]:
    """The rows waiting (`pending`, `sending`), the failed ones, and `sent_24h`: the rows sent
    in the last day. Ranges of idx_outbox_status_time: the work does not grow with the rows
    sent before (a count of every sent row is 50 ms at a million, on the daemon's loop)."""
    since = to_iso((now or utc_now()) - SENT_WINDOW)
    counts = {"pending": 0, "sending": 0, "failed": 0}
    for r in db.query("SELECT status, COUNT(*) FROM outbox WHERE status IN "
                      "('pending', 'sending', 'failed') GROUP BY status"):
        counts[r[0]] = int(r[1])
    counts["sent_24h"] = int(db.scalar(
        "SELECT COUNT(*) FROM outbox WHERE status = 'sent' AND updated_at >= ?", (since,)) or 0)
    return counts
