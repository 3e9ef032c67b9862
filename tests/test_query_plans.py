"""Queries on the per-turn and per-delivery paths seek an index: their cost does not grow with
a chat's history (docs/architecture.md, invariant 11).

A database with a long history (thousands of answered messages and sent outbox rows per chat)
is asked what a turn and a delivery ask: the conversation cursor's messages, the messages a
failed turn sets aside, the cursor itself, the outbox's next open row of a chat. Every
statement they run is traced and its `EXPLAIN QUERY PLAN` read: none may scan `messages` or
`outbox` (a walk of the history) or sort in a temporary B-tree, and the two queries the
issue is about use the index meant for them. Then the work itself is counted (SQLite's
virtual machine steps, through a progress handler): ten times the history costs the same.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mdclaw.outbox import OutboxWorker
from mdclaw.state import Database
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    messages_since,
    set_cursor,
    store_message,
)
from mdclaw.state.failed_turns import mark_messages_failed, message_time
from mdclaw.state.outbox import enqueue
from vm_steps import vm_steps

CHATS = ("tg:1", "tg:2", "tg:3")
JID = "tg:2"


def fill(db: Database, per_chat: int, *, first: int = 0,
         chats: tuple[str, ...] = CHATS) -> None:
    """`per_chat` answered messages and sent outbox rows in each of `chats` (ids from
    `first`)."""
    with db.transaction() as c:
        for jid in chats:
            c.execute("INSERT OR IGNORE INTO chats (jid, last_activity) VALUES (?, 'x')", (jid,))
            c.executemany(
                "INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp) "
                "VALUES (?, ?, 'u', 'U', 'old news', '2025-01-01T00:00:00.000Z')",
                [(f"{jid}:{i}", jid) for i in range(first, first + per_chat)])
            c.executemany(
                "INSERT INTO outbox (chat_jid, kind, text, status, created_at, updated_at, "
                "sent_at) VALUES (?, 'text', 'sent long ago', 'sent', 'x', 'x', 'x')",
                [(jid,)] * per_chat)


def history(tmp_path: Path, per_chat: int) -> Database:
    """A database with `per_chat` messages and sent rows of history in each chat; the cursor
    of group `fam` (chat tg:2) past all of them; then two new messages of one second and two
    open outbox rows in tg:2."""
    db = Database(tmp_path / f"state-{per_chat}.db")
    fill(db, per_chat)
    set_cursor(db, "fam", db.scalar("SELECT MAX(seq) FROM messages"))
    for i in (1, 2):
        store_message(db, StoredMessage(f"{JID}:new{i}", JID, "u", "U", f"new {i}",
                                        "2026-01-01T00:00:07.000Z", False, False))
    fill(db, 50, first=per_chat, chats=("tg:1", "tg:3"))  # the other chats go on
    with db.transaction() as c:
        for text in ("open 1", "open 2"):
            enqueue(c, chat_jid=JID, kind="text", text=text)
    return db


@contextmanager
def traced(db: Database) -> Iterator[list[str]]:
    """Every SQL statement `db` runs inside the block, with its values in place."""
    statements: list[str] = []
    db.conn.set_trace_callback(statements.append)
    try:
        yield statements
    finally:
        db.conn.set_trace_callback(None)


def plan(db: Database, sql: str) -> list[str]:
    return [r[3] for r in db.conn.execute("EXPLAIN QUERY PLAN " + sql)]


def turn_and_delivery(db: Database) -> dict[str, Callable[[], object]]:
    """What a turn and a delivery ask of the database, by name."""
    worker = OutboxWorker(db)
    cursor = get_cursor(db, "fam")

    def set_aside() -> object:
        with db.transaction() as c:
            upto = db.scalar("SELECT MAX(seq) FROM messages WHERE chat_jid = ?", (JID,))
            return (mark_messages_failed(c, JID, cursor, upto, "model_refused"),
                    message_time(c, upto))

    return {
        "cursor": lambda: get_cursor(db, "fam"),
        "messages_since": lambda: messages_since(db, JID, cursor),
        "messages_since_start": lambda: messages_since(db, JID, None, limit=200),
        "move_cursor": lambda: set_cursor(db, "fam", cursor),
        "set_aside": set_aside,
        "outbox_head": lambda: worker._head(JID),
        "outbox_next_rows": lambda: worker._next_rows(JID, 0),
    }


# Plan lines that walk a table's rows (or a whole index of it), or sort.
WALK = re.compile(r"^SCAN (messages|outbox)\b|TEMP B-TREE")


@pytest.mark.parametrize("analyzed", [False, True], ids=["no-stats", "analyzed"])
def test_no_query_of_a_turn_or_a_delivery_walks_the_history_or_sorts(
        tmp_path: Path, analyzed: bool) -> None:
    db = history(tmp_path, 3000)
    if analyzed:  # with statistics (ANALYZE, PRAGMA optimize) the plans must hold too
        db.conn.execute("ANALYZE")
    calls = turn_and_delivery(db)
    with traced(db) as statements:
        results = {name: call() for name, call in calls.items()}
    since, head = results["messages_since"], results["outbox_head"]
    assert [m.content for m in since] == ["new 1", "new 2"]  # type: ignore[attr-defined]
    assert head.text == "open 1"  # type: ignore[attr-defined]
    queries = [s for s in statements
               if re.match(r"\s*(SELECT|UPDATE|DELETE|INSERT)", s, re.IGNORECASE)]
    assert len(queries) >= len(calls)
    walks = {q: [line for line in plan(db, q) if WALK.search(line)] for q in queries}
    assert {q: lines for q, lines in walks.items() if lines} == {}
    # The two queries this is about seek the index meant for them.
    since = next(q for q in queries if "files_pending = 1" in q)
    assert "SEARCH messages USING INDEX idx_messages_chat_jid (chat_jid=? AND seq>? AND seq<?)" \
        in plan(db, since)
    head = next(q for q in queries if "FROM outbox WHERE chat_jid" in q and "LIMIT 1" in q)
    assert plan(db, head) == ["SEARCH outbox USING INDEX idx_outbox_open (chat_jid=?)"]
    db.close()


def steps(db: Database, call: Callable[[], object]) -> int:
    """The virtual machine steps (in thousands) `call` makes SQLite take."""
    with vm_steps(db.conn) as count:
        call()
    return count[0]


def test_ten_times_the_history_costs_no_more(tmp_path: Path) -> None:
    small, large = history(tmp_path, 2_000), history(tmp_path, 20_000)
    small_calls, large_calls = turn_and_delivery(small), turn_and_delivery(large)
    for name in small_calls:
        if name == "messages_since_start":
            continue  # the newest 200 of the whole chat: bounded by its limit, not cheap
        a, b = steps(small, small_calls[name]), steps(large, large_calls[name])
        # A walk of the history takes >= 20 thousand steps here; a seek a handful.
        assert b <= a + 2, f"{name}: {a} thousand steps with 2,000 rows, {b} with 20,000"
    small.close()
    large.close()


def test_the_plans_are_read_from_a_database_the_migrations_made(tmp_path: Path) -> None:
    """The indexes the plans need exist under the names the test reads (a guard against a
    migration that renames one and a test that would then pass for the wrong reason)."""
    db = Database(tmp_path / "state.db")
    indexes = {r[0]: r[1] for r in db.query(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")}
    assert "(chat_jid, seq)" in indexes["idx_messages_chat_jid"]
    assert re.search(r"WHERE status IN \('pending', 'sending'\)", indexes["idx_outbox_open"])
    with pytest.raises(sqlite3.IntegrityError):  # a message id is still stored once
        with db.transaction() as c:
            c.execute("INSERT INTO chats (jid, last_activity) VALUES ('tg:1', 'x')")
            for _ in range(2):
                c.execute("INSERT INTO messages (id, chat_jid, sender, sender_name, content, "
                          "timestamp) VALUES ('tg:1:1', 'tg:1', 'u', 'U', 'x', 'x')")
    db.close()
