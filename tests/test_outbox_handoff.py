"""The IPC engine hands a message to an idle chat straight to the outbox worker: the row is
committed already claimed with the command, and delivered without the worker's look for
due rows or a claim of its own. Order per chat, at-least-once delivery and kill -9 safety
are those of any outbox row. Real files, real SQLite, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import Channel, ChannelError
from mdclaw.channels.http import HttpChannel
from mdclaw.config import load_config
from mdclaw.ipc.apply import BackgroundRemover, IpcEngine
from mdclaw.outbox import EAGER_START, OutboxWorker, RetryPolicy, get_row
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue, has_open_rows, list_outbox
from waiting import wait_until, wait_until_async

REPO = Path(__file__).resolve().parent.parent


class Recording(Channel):
    name = "fake"
    jid_prefix = "fk:"

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str]] = []
        self.connected = True

    async def connect(self) -> None: ...

    async def disconnect(self) -> None: ...

    def is_connected(self) -> bool:
        return self.connected

    async def send_message(self, jid, text, *, reply_to=None, sender=None):  # noqa: ANN001, ANN201
        self.sent.append((jid, text))

    async def send_file(self, *a, **kw):  # noqa: ANN002, ANN003, ANN201
        return None

    async def react(self, jid, message_id, emoji):  # noqa: ANN001, ANN201
        self.sent.append((jid, f"react:{message_id}:{emoji}"))

    async def set_typing(self, *a, **kw):  # noqa: ANN002, ANN003, ANN201
        return None


def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC}}
        groups:
          main: {{name: Main, jid: 'fk:1', main: true}}
          family: {{name: Family, jid: 'fk:2'}}
        """))
    from mdclaw.reconcile import reconcile
    cfg = load_config(path)
    with Database(cfg.db_path) as db:
        reconcile(cfg, db)
    return path


def page_config(tmp_path: Path) -> Path:
    """Groups whose chats are on the local chat page (`hl:`)."""
    path = config(tmp_path)
    path.write_text(path.read_text().replace("'fk:1'", "'hl:main'").replace("'fk:2'",
                                                                              "'hl:family'"))
    from mdclaw.reconcile import reconcile
    cfg = load_config(path)
    with Database(cfg.db_path) as db:
        reconcile(cfg, db)
    return path


def write(tmp_path: Path, group: str, body: dict, n: list[int] = [0]) -> str:  # noqa: B006
    n[0] += 1
    name = f"{time.time_ns():019d}-{n[0]:04d}.json"
    d = tmp_path / "data" / "ipc" / group / "messages"
    d.mkdir(parents=True, exist_ok=True)
    (d / f".{name}.tmp").write_text(json.dumps(body))
    os.rename(d / f".{name}.tmp", d / name)
    return name


class Counting(OutboxWorker):
    """The worker, counting its own looks for due rows and its claims."""

    looks = 0
    claims = 0

    def _due_heads(self, busy=()):  # noqa: ANN001, ANN202
        self.looks += 1
        return super()._due_heads(busy)

    async def _claim(self, rows, **kw):  # noqa: ANN001, ANN003, ANN202
        self.claims += 1
        return await super()._claim(rows, **kw)


def open_rows(db: Database, jid: str) -> int:
    """The chat's rows not yet sent or failed."""
    return int(db.scalar("SELECT count(*) FROM outbox WHERE chat_jid = ? AND status IN "
                         "('pending', 'sending')", (jid,)))


def test_a_message_to_an_idle_chat_goes_out_without_a_look_or_a_claim(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))

    async def main() -> None:
        db = Database(cfg.db_path)
        ch = Recording()
        worker = Counting(db, [ch])
        engine = IpcEngine(cfg, db)
        engine.outbox = worker
        await worker.start()
        await asyncio.sleep(0.05)
        looks = worker.looks
        try:
            write(tmp_path, "family", {"type": "message", "text": "hello"})
            write(tmp_path, "family", {"type": "react", "message_id": "m1", "emoji": "👍"})
            # One round: the first row of the chat is handed over, the second (the chat has
            # an unfinished row now) waits for the worker's own look.
            res = engine.drain()
            assert res.applied == 2
            rows = sorted(list_outbox(db), key=lambda r: r.id)
            if EAGER_START:
                # Sent and marked within the round, before any turn of the event loop.
                assert [r.status for r in rows] == ["sent", "pending"]
                assert ch.sent == [("fk:2", "hello")]
            else:
                assert [r.status for r in rows] == ["sending", "pending"]
            assert rows[0].attempts == 1
            await wait_until_async(lambda: len(ch.sent) == 1)
            assert worker.looks == looks and worker.claims == 0
            worker.wake()  # as the daemon does after a commit with a row not handed over
            await wait_until_async(lambda: len(ch.sent) == 2)
            assert ch.sent == [("fk:2", "hello"), ("fk:2", "react:m1:👍")]
            await wait_until_async(lambda: all(r.status == "sent" for r in list_outbox(db)))
            assert [r.attempts for r in sorted(list_outbox(db), key=lambda r: r.id)] == [1, 1]
        finally:
            await worker.stop()
            engine.close()
            db.close()

    asyncio.run(main())


def test_a_chat_with_an_older_unfinished_row_keeps_its_order(tmp_path: Path) -> None:
    """A row waiting for a retry stays first: the new message is not handed over past it."""
    cfg = load_config(config(tmp_path))

    async def main() -> None:
        db = Database(cfg.db_path)
        ch = Recording()
        worker = Counting(db, [ch])
        engine = IpcEngine(cfg, db)
        engine.outbox = worker
        with db.transaction() as c:
            older = enqueue(c, chat_jid="fk:2", kind="text", text="older")
            c.execute("UPDATE outbox SET next_attempt_at = '2999-01-01T00:00:00.000Z', "
                      "attempts = 1 WHERE id = ?", (older,))
        await worker.start()
        try:
            write(tmp_path, "family", {"type": "message", "text": "newer"})
            engine.drain()
            newer = max(r.id for r in list_outbox(db))
            assert {r.id: r.status for r in list_outbox(db)} == {older: "pending",
                                                                  newer: "pending"}
            worker.wake()
            await asyncio.sleep(0.2)
            assert ch.sent == []  # both wait behind the older row's retry
            with db.transaction() as c:
                c.execute("UPDATE outbox SET next_attempt_at = '2000-01-01T00:00:00.000Z' "
                          "WHERE id = ?", (older,))
            worker.wake()
            await wait_until_async(lambda: len(ch.sent) == 2)
            assert [t for _, t in ch.sent] == ["older", "newer"]
        finally:
            await worker.stop()
            engine.close()
            db.close()

    asyncio.run(main())


def test_no_hand_off_to_a_stopped_worker_or_a_disconnected_channel(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))

    async def main() -> None:
        db = Database(cfg.db_path)
        ch = Recording()
        worker = OutboxWorker(db, [ch])
        engine = IpcEngine(cfg, db)
        engine.outbox = worker
        try:
            write(tmp_path, "family", {"type": "message", "text": "a"})
            engine.drain()  # the worker is not running
            await worker.start()
            ch.connected = False
            write(tmp_path, "main", {"type": "message", "text": "b"})
            engine.drain()
            assert {r.text: r.status for r in list_outbox(db)} == {"a": "pending",
                                                                   "b": "pending"}
        finally:
            await worker.stop()
            engine.close()
            db.close()

    asyncio.run(main())


# The IPC loop and the outbox worker on one event loop, as in the daemon. The channel prints
# each text it is asked to send; "hang" never returns; a file whose text is "die" kills the
# process (SIGKILL) right after its round's COMMIT, before the row is handed over.
CHILD = textwrap.dedent("""
    import asyncio, os, signal, sys
    from mdclaw.channels.base import Channel
    from mdclaw.config import load_config
    from mdclaw.ipc.watcher import IpcWatcher
    from mdclaw.outbox import OutboxWorker
    from mdclaw.state import Database

    class Fake(Channel):
        name = "fake"; jid_prefix = "fk:"
        async def connect(self): pass
        async def disconnect(self): pass
        def is_connected(self): return True
        async def send_message(self, jid, text, **kw):
            print(text, flush=True)
            if text == "hang" and sys.argv[2] == "hang":
                await asyncio.sleep(3600)
        async def send_file(self, *a, **kw): pass
        async def react(self, *a, **kw): pass
        async def set_typing(self, *a, **kw): pass

    async def main():
        cfg = load_config(sys.argv[1])
        db = Database(cfg.db_path)
        outbox = OutboxWorker(db, [Fake()])
        w = IpcWatcher(cfg, db)
        hand_off = outbox.hand_off
        def handing_off(rows):
            # Killed once the round has committed, before the worker has the row.
            if sys.argv[2] == "die" and any(r.text == "die" for r in rows):
                os.kill(os.getpid(), signal.SIGKILL)
            return hand_off(rows)
        outbox.hand_off = handing_off
        def on_commit(items):
            if not all(it.direct is not None for it in items):
                outbox.wake()
        w.engine.on_commit = on_commit
        w.engine.outbox = outbox
        await outbox.start()
        print("ready", flush=True)
        await w.run(asyncio.Event())

    asyncio.run(main())
""")


def _child(cfg: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(cfg), mode], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _lines_until(proc: subprocess.Popen[str], last: str) -> list[str]:
    assert proc.stdout is not None
    out: list[str] = []
    while not out or out[-1] != last:
        line = proc.stdout.readline()
        assert line, f"the process ended before sending {last!r}: {out}"
        out.append(line.strip())
    return out


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_kill_9_between_commit_and_hand_off_or_during_the_send_loses_nothing(
        tmp_path: Path) -> None:
    """Killed right after the COMMIT that wrote a row claimed (before the worker had it), and
    killed while that row's send waits: after a restart each row is delivered, the first
    exactly once, the second again (it was in flight), every row sent in the end."""
    cfg = config(tmp_path)
    db = Database(load_config(cfg).db_path)
    # 1. killed between COMMIT and the hand-off
    proc = _child(cfg, "die")
    try:
        write(tmp_path, "family", {"type": "message", "text": "first"})
        assert _lines_until(proc, "first") == ["first"]
        write(tmp_path, "main", {"type": "message", "text": "die"})
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        _kill(proc)
    row = next(r for r in list_outbox(db) if r.text == "die")
    assert (row.status, row.attempts) == ("sending", 1)  # committed claimed, never tried
    ledger = db.query("SELECT count(*) FROM ipc_ledger WHERE file_name LIKE 'messages/%'")
    assert ledger[0][0] == 2
    # 2. restarted: the row is sent once; then killed while a send waits
    proc = _child(cfg, "hang")
    try:
        assert _lines_until(proc, "die") == ["die"]
        wait_until(lambda: next(r for r in list_outbox(db) if r.text == "die").status
                   == "sent", 10, what="the row killed before its hand-off sent")
        write(tmp_path, "family", {"type": "message", "text": "hang"})
        assert _lines_until(proc, "hang") == ["hang"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        _kill(proc)
    assert next(r for r in list_outbox(db) if r.text == "hang").status == "sending"
    # 3. restarted: the send in flight is made again; nothing else is
    proc = _child(cfg, "ok")
    try:
        assert _lines_until(proc, "hang") == ["hang"]
        wait_until(lambda: all(r.status == "sent" for r in list_outbox(db)), 10,
                   what="every row sent")
    finally:
        _kill(proc)
    assert sorted(r.text for r in list_outbox(db)) == ["die", "first", "hang"]
    # every command file applied once and removed
    assert db.query("SELECT count(*) FROM ipc_ledger")[0][0] == 3
    assert not [p for p in (tmp_path / "data" / "ipc").glob("*/messages/*.json")]
    db.close()


def test_the_open_row_check_seeks_the_index_of_open_rows(tmp_path: Path) -> None:
    """The engine's check for a chat's unfinished rows (once per message it hands over) is a
    seek in idx_outbox_open, whatever the chat's history."""
    db = Database(tmp_path / "s.db")
    with db.transaction() as c:
        for i in range(200):
            enqueue(c, chat_jid="fk:1", kind="text", text=f"m{i}")
        c.execute("UPDATE outbox SET status = 'sent'")
    plan = " ".join(str(tuple(r)) for r in db.query(
        "EXPLAIN QUERY PLAN SELECT 1 FROM outbox WHERE chat_jid = ? AND status IN "
        "('pending', 'sending') LIMIT 1", ("fk:1",)))
    assert "idx_outbox_open" in plan and "SCAN" not in plan, plan
    from mdclaw.state.outbox import has_open_rows
    with db.transaction() as c:
        assert not has_open_rows(c, "fk:1")
        enqueue(c, chat_jid="fk:1", kind="text", text="new")
        assert has_open_rows(c, "fk:1")
    db.close()


def test_a_handed_over_message_is_marked_in_the_turn_it_goes_out(tmp_path: Path) -> None:
    """What runs next on the loop after the worker's turn (the IPC loop's next round) finds
    the chat's delivered row marked `sent` and no drain of the chat under way, so the
    chat's next message can be handed over too (not written pending, for a look and a claim
    of the worker's own)."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = Recording()
        w = OutboxWorker(db, [ch])
        await w.start()
        try:
            rows = []
            with db.transaction() as c:
                for j in ("fk:1", "fk:2", "fk:3"):
                    assert w.accepts(j) and not has_open_rows(c, j)
                    rid = enqueue(c, chat_jid=j, kind="text", text=f"to {j}", claimed=True)
                    rows.append(get_row(db, rid))
            assert all(r is not None for r in rows)
            w.hand_off([dataclasses.replace(r, status="pending", attempts=0) for r in rows])
            await asyncio.sleep(0)  # one turn: as the IPC loop between its rounds
            assert len(ch.sent) == 3
            with db.transaction() as c:
                for j in ("fk:1", "fk:2", "fk:3"):
                    assert w.accepts(j), j
                    assert not has_open_rows(c, j), j
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """The event loop's selector, noting the timeout of every wait: 0 is a turn with work
    ready (a callback queued), more is the loop going idle. `idle`, if set, is resolved
    the first time the loop would go idle (and the loop goes on at once, to see it)."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.idle: asyncio.Future[None] | None = None

    def select(self, timeout=None):  # noqa: ANN001, ANN201
        self.timeouts.append(timeout)
        if timeout != 0 and self.idle is not None:
            if not self.idle.done():
                self.idle.set_result(None)
            self.idle = None
            timeout = 0
        return super().select(timeout)


def test_a_handed_over_message_costs_the_loop_one_turn(tmp_path: Path) -> None:
    """At a trickle a handed-over message is delivered and marked in one turn of the event
    loop after its hand-off (with EAGER_START: within the hand-off, no turn at all), and its
    drain's end asks for no further turn: the loop goes idle straight after (each turn is a
    wake-up, a `select` and the loop's own work, paid per message)."""
    sel = CountingSelector()
    loop = asyncio.SelectorEventLoop(sel)

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = Recording()
        w = OutboxWorker(db, [ch])
        await w.start()
        try:
            sel.idle = asyncio.get_running_loop().create_future()
            await asyncio.wait_for(sel.idle, 30)  # the worker's first look done: it sleeps
            for i in range(3):
                with db.transaction() as c:
                    rid = enqueue(c, chat_jid="fk:1", kind="text", text=f"m{i}", claimed=True)
                row = get_row(db, rid)
                assert row is not None
                sel.timeouts.clear()
                sel.idle = asyncio.get_running_loop().create_future()
                started = w.hand_off([dataclasses.replace(row, status="pending", attempts=0)])
                assert started is EAGER_START
                if EAGER_START:  # sent and marked before hand_off returned
                    assert ch.sent[-1] == ("fk:1", f"m{i}")
                    assert open_rows(db, "fk:1") == 0
                    assert w.accepts("fk:1")  # no drain of the chat left under way
                await asyncio.wait_for(sel.idle, 30)
                assert ch.sent[-1] == ("fk:1", f"m{i}")
                assert open_rows(db, "fk:1") == 0
                # The turns before the loop would first go idle: the hand-off's own.
                turns = next(i for i, t in enumerate(sel.timeouts) if t != 0)
                assert turns == (0 if EAGER_START else 1), sel.timeouts
        finally:
            await w.stop()
            db.close()

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


class Held(Recording):
    """A chat service whose sends wait until `release` is set (a send on the network)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def send_message(self, jid, text, *, reply_to=None, sender=None):  # noqa: ANN001, ANN201
        await self.release.wait()
        self.sent.append((jid, text))


class Refusing(Recording):
    """A chat service that refuses every send, for now."""

    async def send_message(self, jid, text, *, reply_to=None, sender=None):  # noqa: ANN001, ANN201
        raise ChannelError("the service is down")


def _status(db: Database, row_id: int) -> str | None:
    row = get_row(db, row_id)
    return None if row is None else row.status


async def _hand_over(db: Database, w: OutboxWorker, jid: str, text: str) -> int:
    with db.transaction() as c:
        assert w.accepts(jid) and not has_open_rows(c, jid)
        rid = enqueue(c, chat_jid=jid, kind="text", text=text, claimed=True)
    row = get_row(db, rid)
    assert row is not None
    w.hand_off([dataclasses.replace(row, status="pending", attempts=0)])
    return rid


def test_a_handed_over_send_that_waits_keeps_its_chat_until_it_is_marked(
        tmp_path: Path) -> None:
    """A send that waits on the network (its drain's first step suspends, whether it ran
    in the hand-off or a turn later): the chat's drain stays under way, so its next message
    is not handed over past it, until the send is done and marked."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = Held()
        w = OutboxWorker(db, [ch])
        await w.start()
        try:
            rid = await _hand_over(db, w, "fk:1", "slow")
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            assert not w.accepts("fk:1")
            assert w.accepts("fk:2")  # other chats are not held up
            assert _status(db, rid) == "sending" and ch.sent == []
            ch.release.set()
            await wait_until_async(lambda: _status(db, rid) == "sent")
            await wait_until_async(lambda: w.accepts("fk:1"))
            assert ch.sent == [("fk:1", "slow")]
            rid2 = await _hand_over(db, w, "fk:1", "next")
            await wait_until_async(lambda: _status(db, rid2) == "sent")
            assert ch.sent == [("fk:1", "slow"), ("fk:1", "next")]
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())


def test_a_handed_over_send_that_fails_waits_for_its_retry_and_frees_its_chat(
        tmp_path: Path) -> None:
    """A send refused in the drain's first step: the row goes back to pending with its try
    counted and a retry time, and no drain of the chat is left under way (the chat's next
    message is written pending behind it, not handed over past it)."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [Refusing()], policy=RetryPolicy(
            max_attempts=5, base_delay=60.0, factor=2.0, max_delay=60.0, jitter=0))
        await w.start()
        try:
            rid = await _hand_over(db, w, "fk:1", "hello")
            await wait_until_async(lambda: _status(db, rid) == "pending")
            row = get_row(db, rid)
            assert row is not None
            assert row.attempts == 1 and row.next_attempt_at is not None
            assert "the service is down" in (row.last_error or "")
            await wait_until_async(lambda: w.accepts("fk:1"))
            with db.transaction() as c:
                assert has_open_rows(c, "fk:1")  # the writer then queues behind it
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())


@contextlib.asynccontextmanager
async def page_and_engine(tmp_path: Path, worker: type[OutboxWorker] = OutboxWorker,
                          **kw: Any
                          ) -> AsyncIterator[tuple[Database, HttpChannel, Any, IpcEngine]]:
    """Groups on the local chat page, its channel on a loopback server, an outbox worker
    (`worker`, built with `kw`) delivering to it, and the IPC engine handing it rows."""
    cfg = load_config(page_config(tmp_path))
    db = Database(cfg.db_path)
    http = chat_on_server(db)
    await start_chat(http)
    w = worker(db, [http], **kw)
    engine = IpcEngine(cfg, db)
    engine.outbox = w
    await w.start()
    try:
        yield db, http, w, engine
    finally:
        db.conn.set_trace_callback(None)
        await w.stop()
        await stop_chat(http)
        engine.close()
        db.close()


def test_a_message_to_the_chat_page_is_on_it_when_its_command_commits(tmp_path: Path) -> None:
    """The page's row, the outbox row (written `sent`) and the command commit in one
    transaction: no drain, no claim, no transaction of the worker's. A second message to
    the chat in the same round goes the usual way, after it."""
    async def main() -> None:
        sent: list[int] = []
        async with page_and_engine(tmp_path, Counting,
                                   on_sent=lambda row: sent.append(row.id)
                                   ) as (db, http, worker, engine):
            await asyncio.sleep(0.05)
            looks = worker.looks
            commits: list[str] = []
            write(tmp_path, "family", {"type": "message", "text": "one", "sender": "Ann"})
            write(tmp_path, "family", {"type": "message", "text": "two"})
            db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT"
                                       else None)
            res = engine.drain()
            assert res.applied == 2
            # Before the loop turns: the first is on the page and sent, by the round alone;
            # the second, handed over, too with EAGER_START (its drain's first step and
            # mark run in the hand-off), in a transaction of its own.
            assert len(commits) == (2 if EAGER_START else 1)
            assert [r["content"] for r in http.transcript("hl:family")] == (
                ["one", "two"] if EAGER_START else ["one"])
            assert http.transcript("hl:family")[0]["sender_name"] == "Ann"
            rows = sorted(list_outbox(db), key=lambda r: r.id)
            assert [(r.text, r.status, r.attempts) for r in rows] == [
                ("one", "sent", 1), ("two", "sent" if EAGER_START else "sending", 1)]
            assert rows[0].sent_at is not None and rows[0].next_attempt_at is None
            assert sent == ([r.id for r in rows] if EAGER_START else [rows[0].id])
            await wait_until_async(lambda: len(http.transcript("hl:family")) == 2)
            assert [r["content"] for r in http.transcript("hl:family")] == ["one", "two"]
            await wait_until_async(lambda: all(r.status == "sent" for r in list_outbox(db)))
            assert worker.looks == looks and worker.claims == 0
            # The round's transaction, and the second message's own (page row and mark).
            assert len(commits) == 2

    asyncio.run(main())


def test_a_round_whose_messages_are_all_on_the_page_removes_its_files_itself(
        tmp_path: Path) -> None:
    """With the watcher's remover on the loop: a round whose every message went to the
    chat page with its command removes its files before it returns (no send of the round
    waits behind the unlinks); a round that hands a row to the worker leaves them for the
    next turn of the loop, after the send, unless the hand-off started the sends
    (EAGER_START): then it removes them itself too."""
    async def main() -> None:
        async with page_and_engine(tmp_path) as (db, http, worker, engine):
            remover = engine.remover = BackgroundRemover()
            remover.call_soon = asyncio.get_running_loop().call_soon
            folder = tmp_path / "data" / "ipc" / "family" / "messages"
            try:
                first = write(tmp_path, "family", {"type": "message", "text": "one"})
                assert engine.drain().applied == 1
                # Before the loop turns.
                assert not (folder / first).exists()
                assert [r["content"] for r in http.transcript("hl:family")] == ["one"]
                # Two to the same chat: the second is handed to the worker, so the round's
                # files go a turn later.
                names = [write(tmp_path, "family", {"type": "message", "text": t})
                         for t in ("two", "three")]
                assert engine.drain().applied == 2
                if EAGER_START:
                    assert not any((folder / n).exists() for n in names)
                    assert not remover.keys
                    assert [r["content"] for r in http.transcript("hl:family")] == [
                        "one", "two", "three"]
                else:
                    assert all((folder / n).exists() for n in names)
                    assert remover.keys  # hidden from listings until then
                await asyncio.sleep(0)
                assert not any((folder / n).exists() for n in names)
                await wait_until_async(lambda: all(r.status == "sent"
                                                   for r in list_outbox(db)))
                assert [r["content"] for r in http.transcript("hl:family")] == [
                    "one", "two", "three"]
            finally:
                remover.call_soon = None
                remover.close()

    asyncio.run(main())


def test_a_message_the_page_refuses_goes_through_the_outbox_and_is_not_lost(
        tmp_path: Path) -> None:
    """When the page's row cannot be written with the command, nothing of it is: the
    message is written to the outbox the usual way, whose delivery tries again, and it
    shows once when it can."""
    async def main() -> None:
        async with page_and_engine(tmp_path, policy=RetryPolicy(
                max_attempts=5, base_delay=0.1, factor=2.0, max_delay=1.0, jitter=0)
                                   ) as (db, http, _, engine):
            db.conn.execute("CREATE TEMP TRIGGER no_page BEFORE INSERT ON http_messages "
                            "BEGIN SELECT RAISE(ABORT, 'no page today'); END")
            write(tmp_path, "family", {"type": "message", "text": "hello"})
            assert engine.drain().applied == 1
            assert http.transcript("hl:family") == []
            (row,) = list_outbox(db)
            assert row.status in ("sending", "pending")
            await wait_until_async(lambda: (get_row(db, row.id) or row).last_error)
            assert "no page today" in (get_row(db, row.id) or row).last_error
            assert http.transcript("hl:family") == []
            db.conn.execute("DROP TRIGGER no_page")
            await wait_until_async(lambda: (get_row(db, row.id) or row).status == "sent",
                                   timeout=20)
            assert [r["content"] for r in http.transcript("hl:family")] == ["hello"]

    asyncio.run(main())


def test_a_text_longer_than_one_page_message_is_written_once_and_goes_in_parts(
        tmp_path: Path) -> None:
    """A text the page takes as several messages is not delivered with its command: its
    outbox row is written once, handed over, and the worker sends it in parts."""
    async def main() -> None:
        async with page_and_engine(tmp_path) as (db, http, _, engine):
            http.max_message_length = 10
            inserts: list[str] = []
            write(tmp_path, "family", {"type": "message", "text": "one two three four"})
            db.conn.set_trace_callback(
                lambda sql: inserts.append(sql) if sql.startswith("INSERT INTO outbox ")
                else None)
            assert engine.drain().applied == 1
            db.conn.set_trace_callback(None)
            # (The trace names the statement again for each trigger program it runs.)
            assert len(set(inserts)) == 1 and "'sending'" in inserts[0]
            (row,) = list_outbox(db)
            # (With EAGER_START its parts went out in the hand-off already.)
            assert (row.status, row.attempts) == ("sent" if EAGER_START else "sending", 1)
            await wait_until_async(lambda: (get_row(db, row.id) or row).status == "sent")
            parts = [r["content"] for r in http.transcript("hl:family")]
            assert len(parts) > 1
            assert " ".join(p.strip() for p in parts) == "one two three four"

    asyncio.run(main())
