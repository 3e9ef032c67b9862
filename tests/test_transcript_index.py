"""The transcript's full-text index written in batches (migration 17): a stored row waits in
`transcript_unindexed` until a batch moves it into `transcript_fts`; a reply waits in
`transcript_replies_queued` until a batch writes its row (migration 21); a search works off
both first; deletions and changes of waiting and indexed rows keep the index whole; a
process killed (SIGKILL) before, inside and after a batch leaves every message and reply
found exactly once. Real SQLite (FTS5), real subprocesses, the real background thread."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO
from ipc_helpers import FAMILY_JID, WORK_JID, Env
from mdclaw.ipc import writers
from mdclaw.ipc.writers import SnapshotWriter
from mdclaw.paths import Layout
from mdclaw.state import Database
from mdclaw.state.conversations import StoredMessage, settle_files, store_message
from mdclaw.state.outbox import enqueue
from mdclaw.state.transcripts import (
    flush_index,
    index_queued,
    rebuild_index,
    search,
    write_queued_replies,
)
from schema_at import database_at
from waiting import wait_until


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


def integrity(conn: sqlite3.Connection) -> None:
    """FTS5's own check that the index holds exactly the transcript's rows, as they are,
    once the queued rows are added: the queue and the index together hold every row once.
    (The check compares the index with the whole table, so it is made with the queue
    indexed, in a transaction rolled back after.)"""
    conn.execute("BEGIN IMMEDIATE")
    try:
        index_queued(conn, 1 << 30)
        conn.execute("INSERT INTO transcript_fts(transcript_fts, rank) "
                     "VALUES ('integrity-check', 1)")
    finally:
        conn.execute("ROLLBACK")


def queued(db: Database) -> list[int]:
    """Transcript rows waiting for the index."""
    return [r[0] for r in db.query("SELECT id FROM transcript_unindexed ORDER BY id")]


def replies_queued(db: Database) -> list[int]:
    """Replies (outbox ids) waiting for their transcript row."""
    return [r[0] for r in db.query("SELECT id FROM transcript_replies_queued ORDER BY id")]


def indexed(db: Database) -> int:
    """Rows the index holds (one docsize row each)."""
    return int(db.scalar("SELECT COUNT(*) FROM transcript_fts_docsize"))


_n = iter(range(1, 1_000_000))


def say(db: Database, text: str, jid: str = FAMILY_JID) -> str:
    """An inbound message stored as the orchestrator stores it; returns its id."""
    i = next(_n)
    mid = f"{jid}:{i}"
    assert store_message(db, StoredMessage(mid, jid, "u1", "Alice", text,
                                           f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}.000Z",
                                           False, False), channel="tg", is_group=True)
    return mid


def reply(db: Database, text: str, jid: str = FAMILY_JID, folder: str = "family") -> int:
    with db.transaction() as c:
        return enqueue(c, chat_jid=jid, kind="text", text=text, source_group=folder)


def found(db: Database, word: str, folder: str = "family") -> list[int]:
    return [h.id for h in search(db.conn, folder, word, 50)]


# --------------------------------------------------------------------------- storing, searching

def test_storing_queues_the_row_and_a_search_right_after_finds_it(env: Env) -> None:
    db = env.db
    say(db, "the kayak is in the garage")
    rid = reply(db, "paddles are beside the kayak")
    (m_id,) = [r[0] for r in db.query("SELECT id FROM transcript")]
    # Storing wrote no index row: the message's row waits in the index's queue; the reply
    # has no row yet, it waits in the replies' queue.
    assert queued(db) == [m_id] and replies_queued(db) == [rid] and indexed(db) == 0
    # A read-only reader (no write access) finds only what is indexed...
    ro = Database(env.cfg.db_path, readonly=True)
    try:
        assert search(ro.conn, "family", "kayak", 5) == []
        # ...the search that may write works off both queues first, in its own transaction.
        hits = found(db, "kayak")
        (o_id,) = [r[0] for r in db.query("SELECT id FROM transcript WHERE source = 'outbox' "
                                          "AND source_id = ?", (str(rid),))]
        assert sorted(hits) == [m_id, o_id]
        assert queued(db) == [] and replies_queued(db) == [] and indexed(db) == 2
        assert sorted(h.id for h in search(ro.conn, "family", "kayak", 5)) == [m_id, o_id]
    finally:
        ro.close()
    row = db.query_one("SELECT kind, direction, group_folder, chat_jid, body FROM transcript "
                       "WHERE id = ?", (o_id,))
    assert tuple(row) == ("reply", "out", "family", FAMILY_JID, "paddles are beside the kayak")
    integrity(db.conn)
    # Cheap and harmless when nothing waits; a search in the caller's open transaction
    # indexes inside it.
    assert flush_index(db.conn) == 0
    say(db, "canoe trip")
    with db.transaction() as c:
        assert [h.snippet for h in search(c, "family", "canoe", 5)] == ["**canoe** trip"]
    assert queued(db) == [] and indexed(db) == 3
    integrity(db.conn)


def test_batches_take_the_lowest_ids_first_and_keep_the_rest_queued(env: Env) -> None:
    db = env.db
    for i in range(7):
        say(db, f"note number{i}")
    ids = queued(db)
    with db.transaction() as c:
        assert index_queued(c, 3) == 3
    assert queued(db) == ids[3:] and indexed(db) == 3
    integrity(db.conn)
    assert flush_index(db.conn, batch=2) == 4
    assert queued(db) == [] and indexed(db) == 7
    assert [found(db, f"number{i}") for i in range(7)] == [[i_] for i_ in ids]
    integrity(db.conn)
    # A reply is a full batch of 2 (its row written, then indexed) that empties both queues:
    # one transaction, not a second, empty one.
    reply(db, "one reply")
    commits: list[str] = []
    db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    try:
        assert flush_index(db.conn, batch=2) == 2
    finally:
        db.conn.set_trace_callback(None)
    assert commits == ["COMMIT"] and queued(db) == [] and replies_queued(db) == []


# --------------------------------------------------------------------------- deletes, changes

def test_deleting_and_changing_queued_and_indexed_rows_keeps_the_index_whole(env: Env) -> None:
    db = env.db
    old_msg = say(db, "indexed message about the glacier")
    old_out = reply(db, "indexed reply about the glacier")
    flush_index(db.conn)
    new_msg = say(db, "queued message about the glacier")
    new_out = reply(db, "queued reply about the glacier")
    changed_q = say(db, "queued row whose words change")
    changed_i = reply(db, "indexed row whose words change")
    with db.transaction() as c:  # the replies' rows, then index the last one only
        assert write_queued_replies(c) == 2
        c.execute("DELETE FROM transcript_unindexed WHERE id = (SELECT max(id) FROM "
                  "transcript_unindexed)")
        c.execute("INSERT INTO transcript_fts (rowid, body, grp) SELECT id, body, grp "
                  "FROM transcript WHERE id = (SELECT max(id) FROM transcript)")
    unwritten = reply(db, "a reply about the glacier whose row is not written yet")
    integrity(db.conn)
    assert len(queued(db)) == 3 and indexed(db) == 3 and replies_queued(db) == [unwritten]
    # Deletions through the real triggers: a message, an outbox row, each queued and indexed,
    # and a reply whose row is not written.
    with db.transaction() as c:
        for mid in (old_msg, new_msg):
            c.execute("DELETE FROM messages WHERE id = ?", (mid,))
        for oid in (old_out, new_out, unwritten):
            c.execute("DELETE FROM outbox WHERE id = ?", (oid,))
    assert replies_queued(db) == []
    integrity(db.conn)  # before any batch: the queued ones only left the queue
    # Changes of a queued row and of an indexed one.
    with db.transaction() as c:
        c.execute("UPDATE transcript SET body = 'queued row now says avalanche' "
                  "WHERE source = 'messages' AND source_id = ?", (changed_q,))
        c.execute("UPDATE transcript SET body = 'indexed row now says avalanche' "
                  "WHERE source = 'outbox' AND source_id = ?", (str(changed_i),))
    integrity(db.conn)
    assert found(db, "glacier") == []
    assert found(db, "change") == []
    assert len(found(db, "avalanche")) == 2
    assert queued(db) == [] and indexed(db) == int(db.scalar("SELECT COUNT(*) FROM transcript"))
    integrity(db.conn)


def test_a_reused_id_is_indexed_again_whether_its_row_was_queued_or_indexed(env: Env) -> None:
    """transcript.id has no AUTOINCREMENT: the newest row deleted, the next row gets its id.
    The queues hold ids, not a high-water mark, so the new row is indexed all the same."""
    db = env.db
    say(db, "first words")
    mid = say(db, "indexed then deleted: walrus")
    flush_index(db.conn)
    top = int(db.scalar("SELECT max(id) FROM transcript"))
    with db.transaction() as c:
        c.execute("DELETE FROM messages WHERE id = ?", (mid,))
    mid = say(db, "reused id, queued then deleted: narwhal")
    assert int(db.scalar("SELECT max(id) FROM transcript")) == top and queued(db) == [top]
    with db.transaction() as c:
        c.execute("DELETE FROM messages WHERE id = ?", (mid,))
    assert queued(db) == []
    say(db, "reused id again: octopus")
    assert queued(db) == [top]
    assert found(db, "walrus") == [] and found(db, "narwhal") == []
    assert found(db, "octopus") == [top]
    # A reply deleted after its row was written and indexed, one deleted while queued.
    oid = reply(db, "a reply: dolphin")
    assert len(found(db, "dolphin")) == 1
    with db.transaction() as c:
        c.execute("DELETE FROM outbox WHERE id = ?", (oid,))
    oid = reply(db, "deleted while queued: manatee")
    assert replies_queued(db) == [oid]
    with db.transaction() as c:
        c.execute("DELETE FROM outbox WHERE id = ?", (oid,))
    assert replies_queued(db) == []
    reply(db, "once more: beluga")
    assert found(db, "dolphin") == [] and found(db, "manatee") == []
    assert len(found(db, "beluga")) == 1
    integrity(db.conn)


def test_a_message_whose_files_settle_later_is_queued_then(env: Env) -> None:
    """The transcript row written when a message's files settle goes through the queue too
    (task runs' rows and relabelling: tests/test_transcripts.py, integrity-checked)."""
    db = env.db
    assert store_message(db, StoredMessage(
        "f1", FAMILY_JID, "u1", "Alice", "", "2026-01-02T10:00:00.000Z", False, False,
        attachments=({"kind": "document", "name": "budget.xlsx"},), files_pending=True),
        channel="tg", is_group=True)
    assert queued(db) == []  # no row until its files settle
    settle_files(db, "f1", [{"kind": "document", "name": "budget.xlsx",
                             "caption": "numbers for March"}])
    assert len(queued(db)) == 1
    assert len(found(db, "march")) == 1
    integrity(db.conn)


def test_the_index_delete_of_a_row_it_does_not_hold_is_what_the_check_catches(
        env: Env) -> None:
    """The failure the delete trigger avoids, shown to be caught by the check the tests
    use: the index's 'delete' of a row still queued leaves the index inconsistent."""
    db = env.db
    say(db, "indexed words")
    flush_index(db.conn)
    say(db, "never indexed")
    row = db.query_one("SELECT id, body, grp FROM transcript ORDER BY id DESC")
    with pytest.raises(sqlite3.DatabaseError):  # at once, or by the check
        db.conn.execute("INSERT INTO transcript_fts (transcript_fts, rowid, body, grp) "
                        "VALUES ('delete', ?, ?, ?)", tuple(row))
        integrity(db.conn)
    with db.transaction() as c:
        rebuild_index(c)
    integrity(db.conn)
    # And the same row indexed twice (a batch applied without its queue rows removed).
    db.conn.execute("INSERT INTO transcript_fts (rowid, body, grp) VALUES (?, ?, ?)",
                    tuple(row))
    with pytest.raises(sqlite3.DatabaseError):
        integrity(db.conn)


# --------------------------------------------------------------------------- migrations 17, 21


def family_at(path: Path, version: int, rows: str) -> sqlite3.Connection:
    """A database at `version` with the group 'fam' (its chat 'tg:1') and `rows` (SQL)."""
    conn = database_at(path, version)
    conn.executescript("""
        INSERT INTO registered_groups (folder, name, jid, trigger, added_at)
            VALUES ('fam', 'Family', 'tg:1', '@Andy', '2024-01-01T00:00:00.000Z');
        INSERT INTO group_chats (jid, folder) VALUES ('tg:1', 'fam');
    """ + rows)
    return conn


def test_migration_17_keeps_existing_rows_searchable(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    conn = family_at(path, 16, """
        INSERT INTO chats (jid, last_activity) VALUES ('tg:1', 'x');
        INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp)
            VALUES ('m1', 'tg:1', 'u', 'Ann', 'the canoe is in the garage',
                    '2024-01-01T10:00:00.000Z'),
                   ('m2', 'tg:1', 'u', 'Ann', 'a second canoe', '2024-01-01T10:00:01.000Z');
        INSERT INTO outbox (chat_jid, kind, text, source_group, created_at, updated_at)
            VALUES ('tg:1', 'text', 'canoe paddles found', 'fam', '2024-01-01T10:01:00.000Z',
                    'x');
    """)
    assert conn.execute("SELECT COUNT(*) FROM transcript_fts_docsize").fetchone()[0] == 3
    conn.close()
    db = Database(path)
    try:
        assert db.user_version >= 17
        assert queued(db) == [] and indexed(db) == 3  # they were indexed already: as they are
        ro = Database(path, readonly=True)
        try:
            assert len(search(ro.conn, "fam", "canoe", 50)) == 3
        finally:
            ro.close()
        integrity(db.conn)
        # An indexed row deleted after the migration leaves the index properly.
        with db.transaction() as c:
            c.execute("DELETE FROM messages WHERE id = 'm2'")
        integrity(db.conn)
        store_message(db, StoredMessage("m3", "tg:1", "u", "Ann", "canoe again",
                                        "2024-01-05T00:00:00.000Z", False, False))
        assert len(queued(db)) == 1
        assert len(search(db.conn, "fam", "canoe", 50)) == 3
        integrity(db.conn)
    finally:
        db.close()


def test_migration_21_keeps_written_rows_and_queues_new_replies(tmp_path: Path) -> None:
    """A database of version 20 (replies' rows written by the trigger) carried to 21: its
    rows stay as they are, searchable, and a reply stored from then on waits for its row."""
    path = tmp_path / "state.db"
    conn = family_at(path, 20, """
        INSERT INTO outbox (chat_jid, kind, text, source_group, created_at, updated_at)
            VALUES ('tg:1', 'text', 'the canoe is back', 'fam', '2024-01-01T10:01:00.000Z',
                    'x');
    """)
    before = conn.execute("SELECT id, source, source_id, kind, group_folder, body "
                          "FROM transcript").fetchall()
    assert [r[1:] for r in before] == [("outbox", "1", "reply", "fam", "the canoe is back")]
    conn.close()
    db = Database(path)
    try:
        assert db.user_version >= 21
        assert [tuple(r) for r in db.query("SELECT id, source, source_id, kind, group_folder, "
                                           "body FROM transcript")] == before
        assert replies_queued(db) == []
        with db.transaction() as c:
            oid = enqueue(c, chat_jid="tg:1", kind="text", text="a second canoe",
                          source_group="fam")
        assert replies_queued(db) == [oid]
        assert len(search(db.conn, "fam", "canoe", 50)) == 2
        assert replies_queued(db) == [] and queued(db) == []
        integrity(db.conn)
    finally:
        db.close()


# --------------------------------------------------------------------------- the batches

def test_a_trickle_is_indexed_about_once_a_second_by_the_background_thread(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """20 messages a second for 2 s: a handful of index transactions, not one per message;
    every row indexed without a search. And what waits at start is indexed at once."""
    batches: list[int] = []
    real = writers.flush_index

    def counting(conn: sqlite3.Connection, **kw: bool) -> int:
        n = real(conn, **kw)
        if n:
            batches.append(n)
        return n

    monkeypatch.setattr(writers, "flush_index", counting)
    db = env.db
    say(db, "waiting since before the start")
    w = SnapshotWriter(env.cfg.db_path, Layout(env.data))
    try:
        wait_until(lambda: batches == [1], what="the start's batch")
        started = time.monotonic()
        for i in range(40):
            say(db, f"trickle{i}")
            reply(db, f"answer{i}")
            time.sleep(0.05)
        # Each batch counted once its call returns (after its COMMIT: the queue is seen
        # empty a moment before the last batch is counted). A reply counts twice: its row
        # written, then indexed.
        wait_until(lambda: sum(batches) == 121, what="the trickle indexed")
        took = time.monotonic() - started
        assert queued(db) == [] and replies_queued(db) == []
        # 80 rows over 2 s (longer on a loaded machine): a batch a second or so, not one a
        # row; the start's batch, and one more for the second the trickle ends in.
        assert len(batches) <= 2 + math.ceil(took / writers.INDEX_EVERY), (batches, took)
        assert len(batches) < 20, batches
        assert indexed(db) == 81
        integrity(db.conn)
        say(db, "stored just before the stop")
    finally:
        w.close()
    assert queued(db) == [] and indexed(db) == 82  # what was queued at the stop too


def test_the_index_batch_waits_while_the_ipc_loop_is_in_a_burst(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """While `busy` says rounds follow each other, the thread puts its batch off (a search
    still finds the rows: it indexes them first); once the burst is over, it indexes."""
    monkeypatch.setattr(writers, "INDEX_RECHECK", 0.01)
    burst = [True]
    db = env.db
    say(db, "stored during a burst")
    w = SnapshotWriter(env.cfg.db_path, Layout(env.data), busy=lambda: burst[0])
    try:
        wait_until(lambda: w.index_deferrals >= 5, what="the batch put off")
        assert len(queued(db)) == 1 and indexed(db) == 0
        burst[0] = False
        wait_until(lambda: not queued(db), what="the batch after the burst")
        assert indexed(db) == 1
        integrity(db.conn)
    finally:
        w.close()


def test_a_burst_puts_the_index_batch_off_for_index_defer_max_at_most(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "INDEX_RECHECK", 0.01)
    monkeypatch.setattr(writers, "INDEX_DEFER_MAX", 0.3)
    db = env.db
    say(db, "stored during an endless burst")
    w = SnapshotWriter(env.cfg.db_path, Layout(env.data), busy=lambda: True)
    try:
        wait_until(lambda: not queued(db), what="the batch, burst or not")
        assert w.index_deferrals > 0 and indexed(db) == 1
    finally:
        w.close()


def test_memory_search_through_the_ipc_engine_finds_what_was_just_stored(env: Env) -> None:
    say(env.db, "the kayak is booked", FAMILY_JID)
    say(env.db, "work kayak", WORK_JID)
    assert len(queued(env.db)) == 2
    name = env.write("family", {"type": "memory_action", "requestId": "r1",
                                "action": "memory_search",
                                "params": {"query": "kayak", "sources": "sessions"}},
                     sub="actions")
    env.drain_and_run()
    assert not (env.ipc / "family" / "actions" / name).exists()
    got = json.loads((env.ipc / "family" / "action_results" / "r1.json").read_text())
    assert [h["snippet"] for h in got["result"]["hits"]] == ["the **kayak** is booked"]
    assert queued(env.db) == []


# --------------------------------------------------------------------------- SIGKILL

CHILD = textwrap.dedent("""\
    import os, random, sys, threading, time
    from pathlib import Path
    from mdclaw.ipc.writers import SnapshotWriter
    from mdclaw.paths import Layout
    from mdclaw.state import Database
    from mdclaw.state.conversations import StoredMessage, store_message
    from mdclaw.state.outbox import enqueue
    from mdclaw.state.transcripts import flush_index, index_queued

    db_path, data_dir, mode, start, count = sys.argv[1:6]
    start, count = int(start), int(count)
    db = Database(db_path)
    rng = random.Random(start)
    mine = {}  # k -> outbox id or message id
    lock = threading.Lock()

    def out(*words):  # one line in one write: two threads print
        with lock:
            sys.stdout.write(" ".join(map(str, words)) + "\\n")
            sys.stdout.flush()

    def store(k):
        if k % 2 == 0:
            mid = f"tg:2:c{k}"
            store_message(db, StoredMessage(mid, "tg:2", "u1", "Alice",
                                            f"message w{k}z here", "2026-01-01T00:00:00.000Z",
                                            False, False), channel="tg", is_group=True)
            mine[k] = ("messages", mid)
        else:
            with db.transaction() as c:
                oid = enqueue(c, chat_jid="tg:2", kind="text", text=f"reply w{k}z there",
                              source_group="family")
            mine[k] = ("outbox", oid)
        out("stored", k)

    def delete_one():
        k = rng.choice(sorted(mine))
        table, key = mine.pop(k)
        out("deleting", k)  # from here until "deleted" the row may be there or not
        with db.transaction() as c:
            c.execute(f"DELETE FROM {table} WHERE id = ?", (key,))
        out("deleted", k)

    def hang():
        while True:
            time.sleep(60)

    if mode == "random":
        import mdclaw.state.transcripts as transcripts
        real = transcripts.index_queued

        def traced(conn, limit=transcripts.INDEX_BATCH):
            out("batch")  # a batch's transaction is open until "batched"
            n = real(conn, limit)
            time.sleep(0.05)  # the transaction stays open a while: room for an aimed kill
            out("batched", n)
            return n

        transcripts.index_queued = traced
        SnapshotWriter(Path(db_path), Layout(Path(data_dir)))  # its thread indexes
        out("go")
        for k in range(start, start + count):
            store(k)
            if k % 7 == 0:
                delete_one()
        hang()
    for k in range(start, start + count):
        store(k)
    delete_one()
    if mode == "before":
        out("ready")
        hang()
    if mode == "during":
        with db.transaction() as c:
            index_queued(c, count // 3)
        with db.transaction() as c:
            index_queued(c, count // 3)
            out("ready")  # killed with this batch open
            hang()
    if mode == "after":
        flush_index(db.conn)
        out("indexed")
        for k in range(start + count, start + 2 * count):
            store(k)
            delete_one()
        with db.transaction() as c:
            index_queued(c, count // 2)
        out("ready")
        hang()
""")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return env


class _Child:
    """The child process; its lines are read on a thread, so the test waits for events."""

    def __init__(self, script: Path, env: Env, mode: str, start: int, count: int,
                 kill_in_batch: float | None = None) -> None:
        self.lines: list[str] = []
        self.in_batch = False
        self.kill_in_batch = kill_in_batch  # seconds after the 2nd batch began: kill then
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(env.cfg.db_path), str(env.data), mode,
             str(start), str(count)], env=_child_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if (self.kill_in_batch is not None and line.strip() == "batch"
                    and self.lines.count("batch") == 2):
                time.sleep(self.kill_in_batch)  # aimed from here: no poll's delay
                self.proc.send_signal(signal.SIGKILL)

    def saw(self, line: str) -> bool:
        if self.proc.poll() is not None and line not in self.lines:
            assert self.proc.stderr is not None
            raise AssertionError(f"the child exited: {self.proc.stderr.read()}")
        return line in self.lines

    def kill(self) -> tuple[set[int], set[int]]:
        """SIGKILL it; return the keys it said it stored (and did not start deleting) and
        those it said it deleted (committed)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._reader.join(30)
        batch = [x for x in self.lines if x.startswith("batch")]
        self.in_batch = bool(batch) and batch[-1] == "batch"
        stored = {int(x.split()[1]) for x in self.lines if x.startswith("stored ")}
        deleted = {int(x.split()[1]) for x in self.lines if x.startswith("deleted ")}
        deleting = {int(x.split()[1]) for x in self.lines if x.startswith("deleting ")}
        return stored - deleting, deleted


def _check_after_restart(env: Env, tried: range, stored: set[int], deleted: set[int]) -> int:
    """Start as the daemon does (its background thread indexes what a crash left queued),
    then: each key's row is found by a search exactly once if it is there, never if it is
    not; every key said stored and not said deleted is there; the index passes FTS5's check.
    Returns how many rows were still queued at the restart."""
    db = Database(env.cfg.db_path)
    try:
        left = len(queued(db)) + len(replies_queued(db))
        w = SnapshotWriter(env.cfg.db_path, Layout(env.data))
        try:
            wait_until(lambda: not queued(db) and not replies_queued(db),
                       what="the start-up batch")
        finally:
            w.close()
        integrity(db.conn)
        assert indexed(db) == int(db.scalar("SELECT COUNT(*) FROM transcript"))
        rows_of: dict[int, list[int]] = {}
        for r in db.query("SELECT id, body FROM transcript ORDER BY id"):
            m = re.search(r" w(\d+)z ", r[1])
            if m:
                rows_of.setdefault(int(m[1]), []).append(r[0])
        ro = Database(env.cfg.db_path, readonly=True)  # finds what is indexed, nothing more
        try:
            for k in tried:
                word = f"w{k}z"
                rows = rows_of.get(k, [])
                hits = [h.id for h in search(ro.conn, "family", word, 50)]
                assert hits == rows, (k, hits, rows)
                if k in stored and k not in deleted:
                    assert len(rows) == 1, k
                if k in deleted:
                    assert rows == [], k
        finally:
            ro.close()
        return left
    finally:
        db.close()


@pytest.mark.parametrize("mode", ["before", "during", "after"])
def test_sigkill_before_inside_and_after_a_batch(tmp_path: Path, mode: str) -> None:
    env = Env(tmp_path)
    env.db.close()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    stored: set[int] = set()
    deleted: set[int] = set()
    for rnd in range(2):
        start = 1000 * (rnd + 1)
        child = _Child(script, env, mode, start, 60)
        try:
            wait_until(lambda: child.saw("ready"), timeout=60)  # noqa: B023
        finally:
            s, d = child.kill()
        stored |= s
        deleted |= d
        left = _check_after_restart(env, range(1000, start + 120), stored, deleted)
        # What the kill left queued: all of it before a batch, what the open batch held
        # back inside one, the second lot's rest after one.
        assert left > 0, mode
    assert stored


@pytest.mark.slow
def test_sigkill_at_random_moments_while_the_thread_indexes(tmp_path: Path) -> None:
    rng = random.Random(20261126)
    env = Env(tmp_path)
    env.db.close()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    stored: set[int] = set()
    deleted: set[int] = set()
    lefts = []
    inside = 0
    for rnd in range(10):
        start = 100_000 * (rnd + 1)
        # Odd rounds: killed at a random moment. Even rounds: aimed at a batch, 0-10 ms after
        # the second one (the first after start-up) began, its transaction still open.
        aim = rng.uniform(0, 0.01) if rnd % 2 == 0 else None
        child = _Child(script, env, "random", start, 20_000, kill_in_batch=aim)
        try:
            wait_until(lambda: child.saw("go"), timeout=60)  # noqa: B023
            if aim is None:
                time.sleep(rng.uniform(0.3, 2.5))  # the moment of the kill: random on purpose
            else:
                wait_until(lambda: child.proc.poll() is not None, timeout=60)  # noqa: B023
        finally:
            s, d = child.kill()
        inside += child.in_batch
        assert s, "the child stored nothing before the kill"
        stored |= s
        deleted |= d
        lefts.append(_check_after_restart(
            env, range(start, max(s) + 2), stored, deleted))
    # Some kills found rows waiting (stored since the last batch): the restart indexed them.
    assert any(lefts), lefts
    assert inside >= 3, inside  # the aimed kills (5) hit open batches
    print(f"kills inside an index batch's transaction: {inside} of 10; rows left queued: "
          f"{lefts}")
