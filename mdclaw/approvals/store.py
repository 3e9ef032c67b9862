"""The `approvals` table: pending requests for a person's decision, their reply codes, and
the audit of every decision (migration 13 describes the columns).

Every change here takes the caller's connection and runs in the caller's transaction: an
approval is opened in the transaction of the command that asked for it, a decision is one
conditional UPDATE from 'pending' (of two decisions at once exactly one changes the row),
and the settle pass marks a decided approval done in the transaction that carried it out.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from mdclaw.schedule import from_iso, to_iso, utc_now
from mdclaw.state import Database

# Crockford's base32: no I, L, O or U (nothing to misread, nothing rude); a reply's I/L
# and O are read as 1 and 0.
CODE_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
CODE_LENGTH = 4
MAX_WRONG_CODES = 5
STATUSES = ("pending", "approved", "denied", "expired", "answered")
DECIDED = ("approved", "denied", "expired", "answered")
KINDS = ("command", "action", "admission", "question")


def new_code() -> str:
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def normalize_code(text: str) -> str:
    """A code as a person typed it, in the alphabet's spelling (case, I/L/O, dashes)."""
    return (text.strip().upper().replace("-", "").replace("O", "0").replace("I", "1")
            .replace("L", "1"))


def now() -> str:
    return to_iso(utc_now())


@dataclass(frozen=True)
class Approval:
    id: int
    kind: str
    group_folder: str
    subject: str
    summary: str
    request: dict[str, Any]
    rule: str | None
    approver: str
    approvers: tuple[str, ...]
    request_id: str | None
    status: str
    choice: str | None
    decided_by: str | None
    decided_label: str | None
    decided_via: str | None
    created_at: str
    expires_at: str
    decided_at: str | None
    settled_at: str | None
    outcome: str | None
    wrong_codes: int = 0
    codes_locked: bool = False
    codes: dict[str, str] = field(default_factory=dict)  # person -> code (when asked for)
    # The chat the request came from (the agent's turn's chat), None when unknown.
    chat_jid: str | None = None

    @property
    def pending(self) -> bool:
        return self.status == "pending"

    def seconds_to_decide(self) -> float | None:
        if self.decided_at is None:
            return None
        return (from_iso(self.decided_at) - from_iso(self.created_at)).total_seconds()

    def as_dict(self, *, codes: bool = False) -> dict[str, Any]:
        """The audit record (`mdclaw approvals list --json`); reply codes only when asked."""
        d = {k: getattr(self, k) for k in (
            "id", "kind", "group_folder", "subject", "summary", "request", "rule", "approver",
            "approvers", "request_id", "chat_jid", "status", "choice", "decided_by",
            "decided_label", "decided_via", "created_at", "expires_at", "decided_at",
            "settled_at", "outcome", "wrong_codes", "codes_locked")}
        d["approvers"] = list(self.approvers)
        d["seconds_to_decide"] = self.seconds_to_decide()
        if codes:
            d["codes"] = dict(self.codes)
        return d


def _row(r: sqlite3.Row) -> Approval:
    try:
        request = json.loads(r["request"])
    except ValueError:
        request = {}
    return Approval(
        id=r["id"], kind=r["kind"], group_folder=r["group_folder"], subject=r["subject"],
        summary=r["summary"], request=request if isinstance(request, dict) else {},
        rule=r["rule"], approver=r["approver"], approvers=tuple(json.loads(r["approvers"])),
        request_id=r["request_id"], status=r["status"], choice=r["choice"],
        decided_by=r["decided_by"], decided_label=r["decided_label"],
        decided_via=r["decided_via"], created_at=r["created_at"], expires_at=r["expires_at"],
        decided_at=r["decided_at"], settled_at=r["settled_at"], outcome=r["outcome"],
        wrong_codes=r["wrong_codes"], codes_locked=bool(r["codes_locked"]),
        chat_jid=r["chat_jid"])


Conn = sqlite3.Connection | Database


def _q(conn: Conn, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    if isinstance(conn, Database):
        return conn.query(sql, args)
    return conn.execute(sql, args).fetchall()


def insert(conn: sqlite3.Connection, *, kind: str, folder: str, subject: str, summary: str,
           request: dict[str, Any], rule: str | None, approver: str,
           approvers: list[str], timeout: timedelta, request_id: str | None = None,
           chat_jid: str | None = None) -> tuple[int, dict[str, str]]:
    """A pending approval (in the caller's transaction) with a reply code per approver;
    returns (its id, {person: code}). `chat_jid`: the chat the request came from. Raises
    sqlite3.IntegrityError for a second admission of one sender to one group while the
    first waits."""
    assert kind in KINDS
    created = utc_now()
    cur = conn.execute(
        "INSERT INTO approvals (kind, group_folder, subject, summary, request, rule, approver,"
        " approvers, request_id, created_at, expires_at, chat_jid) VALUES (?, ?, ?, ?, ?, ?,"
        " ?, ?, ?, ?, ?, ?)",
        (kind, folder, subject, summary, json.dumps(request, ensure_ascii=False), rule,
         approver, json.dumps(approvers), request_id, to_iso(created),
         to_iso(created + timeout), chat_jid))
    approval_id = int(cur.lastrowid or 0)
    codes = {person: new_code() for person in approvers}
    conn.executemany("INSERT INTO approval_codes (approval_id, person, code) VALUES (?, ?, ?)",
                     [(approval_id, p, c) for p, c in codes.items()])
    return approval_id, codes


def get(conn: Conn, approval_id: int, *, codes: bool = False) -> Approval | None:
    rows = _q(conn, "SELECT * FROM approvals WHERE id = ?", (approval_id,))
    if not rows:
        return None
    a = _row(rows[0])
    if codes:
        got = {r[0]: r[1] for r in _q(conn, "SELECT person, code FROM approval_codes WHERE "
                                            "approval_id = ?", (approval_id,))}
        a = replace(a, codes=got)
    return a


def list_approvals(conn: Conn, *, status: str | None = None, folder: str | None = None,
                   limit: int = 200) -> list[Approval]:
    """The newest approvals first (pending ones by the index on their expiry)."""
    where, args = [], []
    if status == "pending":
        where.append("status = 'pending'")
    elif status is not None:
        where.append("status = ?")
        args.append(status)
    if folder is not None:
        where.append("group_folder = ?")
        args.append(folder)
    # Only the fixed conditions above are joined; every value is a parameter.
    sql = "SELECT * FROM approvals" + (" WHERE " + " AND ".join(where) if where else "")  # noqa: S608
    return [_row(r) for r in _q(conn, sql + " ORDER BY id DESC LIMIT ?", (*args, limit))]


MAX_PENDING_PER_GROUP = 10


def pending_count(conn: Conn, folder: str | None = None) -> int:
    """Pending approvals (of one group): a partial index counts them."""
    if folder is None:
        return int(_q(conn, "SELECT count(*) FROM approvals WHERE status = 'pending'")[0][0])
    # INDEXED BY: left to itself the planner seeks idx_approvals_group, every approval the
    # group ever had (tests/test_history_paths.py counts the work).
    return int(_q(conn, "SELECT count(*) FROM approvals INDEXED BY idx_approvals_pending_group"
                        " WHERE status = 'pending' AND group_folder = ?", (folder,))[0][0])


def decide(conn: sqlite3.Connection, approval_id: int, *, status: str, by: str | None,
           label: str, via: str, choice: str | None = None) -> bool:
    """Record a decision if the approval still waits: True for the one decision that made
    it, False when it was decided (or expired) already. Its reply codes are spent: they
    are deleted (so the codes table holds the pending approvals' only, and a lookup by a
    person's code costs the same after years)."""
    assert status in DECIDED
    won = conn.execute(
        "UPDATE approvals SET status = ?, choice = ?, decided_by = ?, decided_label = ?,"
        " decided_via = ?, decided_at = ? WHERE id = ? AND status = 'pending'",
        (status, choice, by, label, via, now(), approval_id)).rowcount == 1
    if won:
        conn.execute("DELETE FROM approval_codes WHERE approval_id = ?", (approval_id,))
    return won


def due(conn: Conn, at: str | None = None) -> list[int]:
    """Pending approvals whose time is up (an index seek)."""
    return [r[0] for r in _q(conn, "SELECT id FROM approvals WHERE status = 'pending' AND "
                                   "expires_at <= ? ORDER BY expires_at",
                             (at or now(),))]


def next_expiry(conn: Conn) -> str | None:
    rows = _q(conn, "SELECT min(expires_at) FROM approvals WHERE status = 'pending'")
    return rows[0][0] if rows else None


def unsettled(conn: Conn, limit: int = 64) -> list[Approval]:
    """Decided approvals whose outcome is not carried out yet (oldest first)."""
    return [_row(r) for r in _q(conn, "SELECT * FROM approvals WHERE settled_at IS NULL AND "
                                      "status != 'pending' ORDER BY id LIMIT ?", (limit,))]


def mark_settled(conn: sqlite3.Connection, approval_id: int, outcome: str | None) -> bool:
    """Mark a decided approval carried out: True for the one call that did."""
    return conn.execute(
        "UPDATE approvals SET settled_at = ?, outcome = coalesce(?, outcome) WHERE id = ? AND"
        " settled_at IS NULL AND status != 'pending'",
        (now(), outcome, approval_id)).rowcount == 1


def by_code(conn: sqlite3.Connection, person: str, code: str) -> Approval | None:
    """The pending approval whose reply code for `person` is `code` (codes not locked)."""
    rows = conn.execute(
        "SELECT a.* FROM approval_codes c JOIN approvals a ON a.id = c.approval_id WHERE"
        " c.person = ? AND c.code = ? AND a.status = 'pending' AND a.codes_locked = 0",
        (person, normalize_code(code))).fetchall()
    return _row(rows[0]) if rows else None


def pending_for(conn: Conn, person: str) -> list[Approval]:
    """Pending approvals `person` may decide."""
    return [_row(r) for r in _q(
        conn, "SELECT a.* FROM approval_codes c JOIN approvals a ON a.id = c.approval_id"
              " WHERE c.person = ? AND a.status = 'pending' ORDER BY a.id", (person,))]


def wrong_code(conn: sqlite3.Connection, person: str) -> list[int]:
    """A wrong code from `person`: count it against every approval they may decide; return
    the ids whose codes this locked (MAX_WRONG_CODES reached)."""
    ids = [a.id for a in pending_for(conn, person) if not a.codes_locked]
    locked = []
    for approval_id in ids:
        conn.execute("UPDATE approvals SET wrong_codes = wrong_codes + 1 WHERE id = ?",
                     (approval_id,))
        if conn.execute("UPDATE approvals SET codes_locked = 1 WHERE id = ? AND"
                        " wrong_codes >= ? AND codes_locked = 0",
                        (approval_id, MAX_WRONG_CODES)).rowcount:
            locked.append(approval_id)
    return locked


def code_of(conn: Conn, approval_id: int, person: str) -> str | None:
    rows = _q(conn, "SELECT code FROM approval_codes WHERE approval_id = ? AND person = ?",
              (approval_id, person))
    return rows[0][0] if rows else None


def add_card(conn: sqlite3.Connection, approval_id: int, chat_jid: str, outbox_id: int) -> None:
    conn.execute("INSERT OR REPLACE INTO approval_cards (approval_id, chat_jid, outbox_id)"
                 " VALUES (?, ?, ?)", (approval_id, chat_jid, outbox_id))


def cards(conn: Conn, approval_id: int) -> list[tuple[str, int]]:
    """(chat, outbox row) of every card sent for the approval."""
    return [(r[0], r[1]) for r in _q(conn, "SELECT chat_jid, outbox_id FROM approval_cards"
                                           " WHERE approval_id = ?", (approval_id,))]


def by_card_message(conn: Conn, outbox_id: int) -> int | None:
    rows = _q(conn, "SELECT approval_id FROM approval_cards WHERE outbox_id = ?", (outbox_id,))
    return rows[0][0] if rows else None


