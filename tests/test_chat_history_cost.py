"""The web chat's look at the replies not delivered yet (every long poll of an open page)
reads the rows waiting and failed, never the chat's history of sent replies: its answer is
the same and its work does not grow with ten times the history, with and without the
statistics of a long-lived install (ANALYZE)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from http_helpers import chat_on_server
from mdclaw.channels.http import PENDING_SQL
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue
from vm_steps import vm_steps


def _history(db: Database, sent: int) -> dict[str, int]:
    """`sent` delivered replies to hl:main (and as many to hl:other) around a few rows that
    are not delivered: the ids of those, by what they are."""
    stamp = "2024-01-01T00:00:00.000Z"
    with db.transaction() as c:
        for jid in ("hl:main", "hl:other"):
            c.executemany(
                "INSERT INTO outbox (chat_jid, kind, text, status, attempts, source_group, "
                "created_at, updated_at, sent_at) VALUES (?, 'text', ?, 'sent', 1, 'main', "
                "?, ?, ?)", [(jid, f"old {n}", stamp, stamp, stamp) for n in range(sent)])
        ids = {
            "failed": enqueue(c, chat_jid="hl:main", kind="text", text="it failed"),
            "pending": enqueue(c, chat_jid="hl:main", kind="text", text="**soon**"),
            "sending": enqueue(c, chat_jid="hl:main", kind="file", file_path="/x/a.png",
                               file_name="a.png", claimed=True),
            "reaction": enqueue(c, chat_jid="hl:main", kind="reaction", message_id="m1",
                                emoji="👍"),
            "card": enqueue(c, chat_jid="hl:main", kind="text", card='{"text": "ok?"}'),
            "elsewhere": enqueue(c, chat_jid="hl:other", kind="text", text="not here"),
        }
        c.execute("UPDATE outbox SET status = 'failed', last_error = 'chat not found' "
                  "WHERE id = ?", (ids["failed"],))
    return ids


def _steps(db: Database, fn: Callable[[], list[dict[str, Any]]]
           ) -> tuple[list[dict[str, Any]], int]:
    """fn()'s result and the virtual machine steps it took (in tens)."""
    with vm_steps(db.conn, 10) as steps:
        got = fn()
    return got, steps[0]


@pytest.mark.parametrize("analyzed", [False, True], ids=["no-stats", "analyzed"])
def test_the_replies_not_delivered_are_read_without_the_chats_history(
        tmp_path: Path, analyzed: bool) -> None:
    work = []
    for sent in (300, 3000):
        db = Database(tmp_path / f"{sent}.db")
        ids = _history(db, sent)
        if analyzed:
            db.conn.execute("ANALYZE")
        ch = chat_on_server(db)
        got, steps = _steps(db, lambda ch=ch: ch.pending("hl:main"))
        assert [(r["id"], r["state"]) for r in got] == [
            (ids["failed"], "failed"), (ids["pending"], "sending"), (ids["sending"], "sending")]
        assert got[0]["error"] == "chat not found"
        assert got[1]["html"] == "<p><strong>soon</strong></p>"
        assert got[2]["file_name"] == "a.png"
        plan = [r[3] for r in db.conn.execute("EXPLAIN QUERY PLAN " + PENDING_SQL,
                                              ("hl:main", 20))]
        assert plan[0] == "SEARCH outbox USING INDEX idx_outbox_status_time (status=?)", plan
        work.append(steps)
        db.close()
    small, large = work
    # A walk of the chat's sent rows is thousands of steps more at 3,000 rows than at 300.
    assert large <= small + 20, work


def test_migration_19_drops_the_index_of_every_row_by_chat(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    names = {r[0] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'index' AND "
                                    "tbl_name = 'outbox'")}
    assert "idx_outbox_chat" not in names
    assert {"idx_outbox_open", "idx_outbox_status_time", "idx_outbox_failed"} <= names
    db.close()
    with pytest.raises(sqlite3.OperationalError):  # nothing names it any more
        sqlite3.connect(tmp_path / "state.db").execute(
            "SELECT id FROM outbox INDEXED BY idx_outbox_chat WHERE chat_jid = 'x'")
