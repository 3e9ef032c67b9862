"""State database: schema from empty, migration of the oldest (version 1) database, constraints."""

from __future__ import annotations

import sqlite3

import pytest

from mdclaw.state import Database, DatabaseError
from mdclaw.state.groups import get_group
from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS
from schema_at import database_at

ORIGINAL_TABLES = {"chats", "messages", "registered_groups", "router_state", "sessions",
               "scheduled_tasks", "task_run_logs"}


def columns(db: Database, table: str) -> list[str]:
    return [r["name"] for r in db.query(f"PRAGMA table_info({table})")]


def test_empty_database_gets_latest_schema(tmp_path) -> None:
    db = Database(tmp_path / "state.db")
    assert db.user_version == LATEST_VERSION
    tables = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type='table'")}
    assert ORIGINAL_TABLES | {"ipc_ledger", "outbox"} <= tables
    assert db.query_one("PRAGMA journal_mode")[0] == "wal"
    assert db.query_one("PRAGMA foreign_keys")[0] == 1
    assert columns(db, "scheduled_tasks")[:12] == [
        "id", "group_folder", "chat_jid", "prompt", "schedule_type", "schedule_value",
        "context_mode", "next_run", "last_run", "last_result", "status", "created_at"]
    indexes = {r["name"] for r in db.query("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"idx_chats_last_activity", "idx_messages_chat_jid", "idx_messages_timestamp",
            "idx_scheduled_tasks_status", "idx_scheduled_tasks_next_run",
            "idx_task_run_logs_task_id"} <= indexes
    assert oct((tmp_path / "state.db").stat().st_mode & 0o777) == oct(0o600)


def test_check_constraints_hold(tmp_path) -> None:
    db = Database(tmp_path / "state.db")
    with pytest.raises(sqlite3.IntegrityError):
        with db.transaction() as c:
            c.execute("INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, "
                      "schedule_type, schedule_value, created_at) VALUES "
                      "('t', 'g', 'j', 'p', 'hourly', 'x', 'now')")
    with pytest.raises(sqlite3.IntegrityError):
        with db.transaction() as c:
            c.execute("INSERT INTO outbox (chat_jid, kind, created_at, updated_at) "
                      "VALUES ('j', 'smoke', 'n', 'n')")
    with pytest.raises(sqlite3.IntegrityError):  # foreign keys are on
        with db.transaction() as c:
            c.execute("INSERT INTO task_run_logs (task_id, run_at, duration_ms, status) "
                      "VALUES ('missing', 'n', 0, 'success')")


def test_only_one_main_group(tmp_path) -> None:
    db = Database(tmp_path / "state.db")
    ins = ("INSERT INTO registered_groups (folder, name, jid, added_at, is_main) "
           "VALUES (?, ?, ?, 'n', 1)")
    with db.transaction() as c:
        c.execute(ins, ("a", "A", "x:1"))
    with pytest.raises(sqlite3.IntegrityError):
        with db.transaction() as c:
            c.execute(ins, ("b", "B", "x:2"))


def test_migrates_the_original_database_keeping_rows(tmp_path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0][2])
    conn.executescript("""
        INSERT INTO chats VALUES ('tg:1', 'Chat', '2024-01-01T00:00:00.000Z', 'telegram', 1);
        INSERT INTO messages VALUES ('m1', 'tg:1', 'u', 'U', 'hello',
                                     '2024-01-01T00:00:00.000Z', 0, 0);
        INSERT INTO registered_groups (folder, name, jid, trigger, added_at)
            VALUES ('fam', 'Family', 'tg:1', '@Andy', '2024-01-01T00:00:00.000Z');
        INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,
            schedule_value, context_mode, next_run, status, created_at)
            VALUES ('t1', 'fam', 'tg:1', 'weather', 'cron', '0 8 * * *', 'isolated',
                    '2024-01-02T08:00:00.000Z', 'paused', '2024-01-01T00:00:00.000Z');
        INSERT INTO task_run_logs (task_id, run_at, duration_ms, status, result)
            VALUES ('t1', '2024-01-01T08:00:00.000Z', 1200, 'success', 'sunny');
        PRAGMA user_version = 1;
    """)
    conn.close()
    db = Database(path)
    assert db.user_version == LATEST_VERSION
    t = db.query_one("SELECT * FROM scheduled_tasks WHERE id='t1'")
    assert (t["prompt"], t["status"], t["context_mode"], t["source"], t["catch_up"]) == (
        "weather", "paused", "isolated", "ipc", 1)
    log = db.query_one("SELECT * FROM task_run_logs")
    assert (log["task_id"], log["result"], log["duration_ms"]) == ("t1", "sunny", 1200)
    g = db.query_one("SELECT * FROM registered_groups")
    assert (g["folder"], g["source"], g["is_main"]) == ("fam", "ipc", 0)
    assert get_group(db, "fam").allow_senders is None  # an old group: everyone may, as before
    assert db.query_one("SELECT content FROM messages")[0] == "hello"
    # the widened CHECK accepts the new statuses now
    with db.transaction() as c:
        c.execute("UPDATE scheduled_tasks SET status='running' WHERE id='t1'")
        c.execute("INSERT INTO task_run_logs (task_id, run_at, duration_ms, status) "
                  "VALUES ('t1', 'n', 0, 'interrupted')")
    assert db.query_one("PRAGMA foreign_key_check") is None


def test_migration_is_idempotent_and_refuses_newer(tmp_path) -> None:
    path = tmp_path / "state.db"
    Database(path).close()
    db = Database(path)
    assert db.migrate() == []
    db.conn.execute(f"PRAGMA user_version={LATEST_VERSION + 1}")
    db.close()
    with pytest.raises(DatabaseError, match="newer"):
        Database(path)


def test_failed_transaction_rolls_back(tmp_path) -> None:
    db = Database(tmp_path / "state.db")
    with pytest.raises(RuntimeError):
        with db.transaction() as c:
            c.execute("INSERT INTO router_state VALUES ('k', 'v')")
            raise RuntimeError("boom")
    assert db.query_one("SELECT * FROM router_state") is None


def _cursor_migration() -> list[str]:
    """The statements of the migration that numbers messages that touch the cursors."""
    from mdclaw.state.db import _split_sql

    (script,) = [s for v, d, s in MIGRATIONS if "host's sequence" in d]
    return [s for s in _split_sql(script) if "router_state" in s]


def test_cursors_carry_over_to_the_sequence_exactly(tmp_path) -> None:
    """A database of the schema before messages were numbered: every group's cursor (a
    timestamp) becomes the seq of the last message at or before it in its chat, so each group
    has exactly the messages after its cursor it had before; nothing else changes, and doing
    it again changes nothing."""
    from mdclaw.state.conversations import (
        StoredMessage,
        get_cursor,
        messages_since,
        store_message,
    )

    path = tmp_path / "state.db"
    conn = database_at(path, 11)
    conn.executescript("""
        INSERT INTO chats (jid, last_activity) VALUES ('tg:1', 'x'), ('tg:2', 'x'), ('tg:3', 'x');
        INSERT INTO registered_groups (folder, name, jid, trigger, added_at) VALUES
            ('fam', 'Family', 'tg:1', '@Andy', 'x'), ('work', 'Work', 'tg:2', '@Andy', 'x'),
            ('new', 'New', 'tg:3', '@Andy', 'x'), ('gone', 'Gone', NULL, '@Andy', 'x');
        -- Stored out of time order (a late delivery), two of one second, a failed one, one
        -- with files still pending.
        INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp,
                              failed_cause, attachments, files_pending) VALUES
            ('tg:1:3', 'tg:1', 'u', 'U', 'three', '2026-01-01T00:00:03.000Z', NULL, NULL, 0),
            ('tg:1:1', 'tg:1', 'u', 'U', 'one', '2026-01-01T00:00:01.000Z', 'model_refused',
             NULL, 0),
            ('tg:1:2a', 'tg:1', 'u', 'U', 'two a', '2026-01-01T00:00:02.000Z', NULL, NULL, 0),
            ('tg:1:2b', 'tg:1', 'u', 'U', 'two b', '2026-01-01T00:00:02.000Z', NULL, NULL, 0),
            ('tg:2:1', 'tg:2', 'u', 'U', 'w1', '2026-01-01T00:00:01.500Z', NULL, NULL, 0),
            ('tg:2:2', 'tg:2', 'u', 'U', 'w2', '2026-01-01T00:00:04.000Z', NULL,
             '[{"kind": "photo", "name": "a.jpg"}]', 1),
            ('tg:3:1', 'tg:3', 'u', 'U', 'n1', '2026-01-01T00:00:05.000Z', NULL, NULL, 0);
        INSERT INTO router_state (key, value) VALUES
            ('last_agent_timestamp:fam', '2026-01-01T00:00:02.000Z'),
            ('last_agent_timestamp:work', '2026-01-01T00:00:03.000Z'),
            ('last_agent_timestamp:new', ''),
            ('last_agent_timestamp:gone', '2026-01-01T00:00:02.500Z'),
            ('telegram_offset:1', '77');
    """)
    old_after = {
        folder: [r[0] for r in conn.execute(
            "SELECT id FROM messages WHERE chat_jid = ? AND timestamp > ? "
            "ORDER BY timestamp, id", (jid, cursor))]
        for folder, jid, cursor in conn.execute(
            "SELECT g.folder, g.jid, r.value FROM registered_groups g JOIN router_state r "
            "ON r.key = 'last_agent_timestamp:' || g.folder WHERE g.jid IS NOT NULL")}
    assert old_after == {"fam": ["tg:1:3"], "work": ["tg:2:2"], "new": ["tg:3:1"]}
    conn.close()

    db = Database(path)
    assert db.user_version == LATEST_VERSION
    seq = {r["id"]: r["seq"] for r in db.query("SELECT id, seq FROM messages")}
    # Numbered in time order (then the order stored), whatever order they were stored in.
    assert sorted(seq, key=seq.get) == ["tg:1:1", "tg:2:1", "tg:1:2a", "tg:1:2b", "tg:1:3",
                                        "tg:2:2", "tg:3:1"]
    assert get_cursor(db, "fam") == seq["tg:1:2b"]  # the last of its second
    assert get_cursor(db, "work") == seq["tg:2:1"]
    assert get_cursor(db, "new") == 0
    assert get_cursor(db, "gone") == seq["tg:1:2b"]  # no chat: the last of any chat before it
    for folder, jid in (("fam", "tg:1"), ("work", "tg:2"), ("new", "tg:3")):
        after = db.query("SELECT id FROM messages WHERE chat_jid = ? AND seq > ? ORDER BY seq",
                         (jid, get_cursor(db, folder)))
        assert [r[0] for r in after] == old_after[folder]
    assert [m.id for m in messages_since(db, "tg:1", get_cursor(db, "fam"))] == ["tg:1:3"]
    assert messages_since(db, "tg:2", get_cursor(db, "work")) == []  # held behind its files
    # Everything else is kept.
    assert db.query_one("SELECT failed_cause FROM messages WHERE id = 'tg:1:1'")[0] == \
        "model_refused"
    row = db.query_one("SELECT attachments, files_pending FROM messages WHERE id = 'tg:2:2'")
    assert (row[0], row[1]) == ('[{"kind": "photo", "name": "a.jpg"}]', 1)
    assert db.query_one("SELECT value FROM router_state WHERE key = 'telegram_offset:1'")[0] \
        == "77"
    assert db.query_one("SELECT COUNT(*) FROM router_state WHERE key LIKE 'last_agent%'")[0] == 0
    # The rebuilt table keeps its triggers (the transcript), and ids stay unique.
    assert store_message(db, StoredMessage("tg:1:4", "tg:1", "u", "U", "four",
                                           "2026-01-01T00:00:03.000Z", False, False))
    assert not store_message(db, StoredMessage("tg:1:4", "tg:1", "u", "U", "four",
                                               "2026-01-01T00:00:03.000Z", False, False))
    assert db.query_one("SELECT body FROM transcript WHERE source_id = 'tg:1:4'")[0] == "four"
    assert db.query_one("SELECT seq FROM messages WHERE id = 'tg:1:4'")[0] > max(seq.values())
    assert db.query_one("PRAGMA foreign_key_check") is None
    # Again: nothing changes.
    before = [tuple(r) for r in db.query("SELECT * FROM router_state ORDER BY key")]
    with db.transaction() as c:
        for statement in _cursor_migration():
            c.execute(statement)
    assert [tuple(r) for r in db.query("SELECT * FROM router_state ORDER BY key")] == before
    assert db.migrate() == []
    db.close()
