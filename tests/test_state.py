"""State database: schema from empty, migration of the oldest (version 1) database, constraints."""

from __future__ import annotations

import sqlite3

import pytest

from mdclaw.state import Database, DatabaseError
from mdclaw.state.groups import get_group
from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS

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
