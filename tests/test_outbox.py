"""The outbox worker against real SQLite: delivery, splitting, backoff, failure, restarts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import Channel, ChannelError
from mdclaw.channels.http import HttpChannel
from mdclaw.outbox import (
    BATCH,
    MARKS_MAX,
    OutboxWorker,
    RetryPolicy,
    describe_failures,
    failed_since,
    get_row,
)
from mdclaw.state import Database
from mdclaw.state.outbox import OutboxRow, enqueue, outbox_counts, outbox_row, outbox_rows
from waiting import wait_until, wait_until_async

REPO = Path(__file__).resolve().parent.parent
FAST = RetryPolicy(max_attempts=3, base_delay=0.1, factor=2.0, max_delay=1.0, jitter=0)


class ScriptedChannel(Channel):
    """A chat service stand-in: records what it is asked to send; `failures` holds the
    errors the next calls raise, in order."""

    name = "fake"
    jid_prefix = "fk:"

    def __init__(self, max_len: int = 4096) -> None:
        super().__init__()
        self.max_message_length = max_len
        self.sent: list[tuple[str, str]] = []
        self.calls: list[float] = []
        self.failures: list[Exception] = []
        self.connected = True

    async def connect(self) -> None:
        self.connected = True

    async def disconnect(self) -> None:
        self.connected = False

    def is_connected(self) -> bool:
        return self.connected

    def _maybe_fail(self) -> None:
        self.calls.append(time.monotonic())
        if self.failures:
            raise self.failures.pop(0)

    async def send_message(self, jid, text, *, reply_to=None, sender=None):
        self._maybe_fail()
        self.sent.append((jid, text))
        return f"{jid}:{len(self.sent)}"

    async def send_file(self, jid, path, *, file_name=None, caption=None):
        self._maybe_fail()
        self.sent.append((jid, f"file:{file_name or Path(path).name}:{Path(path).read_text()}"))
        return None

    async def react(self, jid, message_id, emoji):
        self._maybe_fail()
        self.sent.append((jid, f"react:{message_id}:{emoji}"))

    async def set_typing(self, jid, typing):
        pass


def put(db: Database, jid: str = "fk:1", text: str | None = "hello", **kw) -> int:
    kw.setdefault("kind", "text")
    kw.setdefault("source_group", "main")
    with db.transaction() as c:
        return enqueue(c, chat_jid=jid, text=text, **kw)


def status(db: Database, row_id: int) -> str:
    row = get_row(db, row_id)
    assert row is not None
    return row.status


@contextlib.asynccontextmanager
async def page_and_worker(tmp_path: Path, **kw: Any
                          ) -> AsyncIterator[tuple[Database, HttpChannel, OutboxWorker]]:
    """A state.db, the local HTTP channel (`kw`) on a loopback server, and an outbox
    worker with quick retries that delivers to it."""
    db = Database(tmp_path / "s.db")
    http = chat_on_server(db, **kw)
    await start_chat(http)
    try:
        yield db, http, OutboxWorker(db, [http], policy=FAST)
    finally:
        await stop_chat(http)
        db.close()


def test_policy_delays_grow_and_cap() -> None:
    p = RetryPolicy(max_attempts=5, base_delay=2, factor=2, max_delay=10, jitter=0)
    assert [p.delay(n) for n in range(1, 6)] == [2, 4, 8, 10, 10]
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=2)


def test_policy_delays_are_jittered_by_default_within_the_upper_half() -> None:
    p = RetryPolicy(max_attempts=5, base_delay=2, factor=2, max_delay=10,
                    rng=random.Random(1))
    for n, nominal in zip(range(1, 6), [2, 4, 8, 10, 10], strict=True):
        got = [p.delay(n) for _ in range(200)]
        assert all(nominal / 2 <= d <= nominal for d in got)
        assert len(set(got)) > 150


def test_outbox_rows_take_each_field_by_its_column_name(tmp_path: Path) -> None:
    db = Database(tmp_path / "s.db")
    with db.transaction() as c:
        a = enqueue(c, chat_jid="fk:1", kind="text", text="hello", reply_to="m7",
                    sender="Ann", source_group="main")
        b = enqueue(c, chat_jid="fk:2", kind="reaction", message_id="m9", emoji="👍",
                    claimed=True)
    by_name = {r["id"]: {k: r[k] for k in r.keys()}  # noqa: SIM118 - sqlite3.Row
               for r in db.query("SELECT * FROM outbox")}
    fields = list(OutboxRow.__dataclass_fields__)
    # The table's own order, the columns in reverse with one more, and one row alone.
    plain = outbox_rows(db.query("SELECT * FROM outbox ORDER BY id"))
    cols = ", ".join(reversed(fields))
    mixed = outbox_rows(db.query(f"SELECT {cols}, 5 AS unfinished FROM outbox ORDER BY id"))  # noqa: S608
    one = outbox_row(db.query_one("SELECT 1 AS n, * FROM outbox WHERE id = ?", (b,)))
    for rows in (plain, mixed):
        assert [r.id for r in rows] == [a, b]
        for r in rows:
            assert {k: getattr(r, k) for k in fields} == {k: by_name[r.id][k] for k in fields}
    assert one == mixed[1]
    assert (one.kind, one.emoji, one.status, one.attempts) == ("reaction", "👍", "sending", 1)
    assert (mixed[0].text, mixed[0].reply_to, mixed[0].sender) == ("hello", "m7", "Ann")
    assert outbox_rows([]) == []
    with pytest.raises(ValueError, match="emoji"):
        outbox_rows(db.query("SELECT id, chat_jid FROM outbox"))


def test_delivers_on_wake_and_marks_sent(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        sent_rows = []
        w = OutboxWorker(db, [ch], policy=FAST, max_idle=30, on_sent=sent_rows.append)
        await w.start()
        try:
            await asyncio.sleep(0.1)  # idle: waiting up to 30 s unless woken
            t0 = time.monotonic()
            rid = put(db, text="hi")
            f = tmp_path / "a.txt"
            f.write_text("data")
            fid = put(db, kind="file", text=None, file_path=str(f), file_name="a.txt")
            xid = put(db, kind="reaction", text=None, message_id="fk:1:7", emoji="+1")
            w.wake()
            await wait_until_async(lambda: status(db, xid) == "sent")
            assert time.monotonic() - t0 < 5.0  # not the 30 s idle wait
            assert ch.sent == [("fk:1", "hi"), ("fk:1", "file:a.txt:data"),
                               ("fk:1", "react:fk:1:7:+1")]
            row = get_row(db, rid)
            assert row.status == "sent" and row.sent_at and row.attempts == 1
            assert status(db, fid) == "sent"
            assert [r.id for r in sent_rows] == [rid, fid, xid]
            assert outbox_counts(db) == {"pending": 0, "sending": 0, "sent": 3, "failed": 0}
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())


def test_split_at_channel_limit_and_resume_after_failed_piece(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel(max_len=10)
        text = "alpha beta gamma delta epsilon zeta"
        w = OutboxWorker(db, [ch], policy=FAST)
        rid = put(db, text=text)
        # the third piece fails once: the first round stops there
        orig = ch.send_message
        count = {"n": 0}

        async def flaky(jid, piece, **kw):
            count["n"] += 1
            if count["n"] == 3:
                raise ChannelError("connection reset")
            return await orig(jid, piece, **kw)

        ch.send_message = flaky  # type: ignore[method-assign]
        await w.run_once()
        row = get_row(db, rid)
        assert row.status == "pending" and "connection reset" in row.last_error
        assert len(ch.sent) == 2
        await asyncio.sleep(0.15)
        await w.run_once()
        assert status(db, rid) == "sent"
        pieces = [t for _, t in ch.sent]
        assert all(len(p) <= 10 for p in pieces)
        assert " ".join(pieces) == text  # nothing repeated, nothing lost
        assert db.query("SELECT * FROM outbox_progress") == []
        db.close()

    asyncio.run(main())


def test_retries_with_backoff_then_failed_with_reason(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        ch.failures = [ChannelError(f"502 bad gateway #{i}") for i in range(10)]
        failed = []
        w = OutboxWorker(db, [ch], policy=FAST, on_failed=failed.append)
        await w.start()
        try:
            rid = put(db)
            w.wake()
            await wait_until_async(lambda: status(db, rid) == "failed")
            row = get_row(db, rid)
            assert row.attempts == 3
            assert row.last_error == "gave up after 3 attempt(s): 502 bad gateway #2"
            gaps = [b - a for a, b in zip(ch.calls, ch.calls[1:], strict=False)]
            assert gaps[0] >= 0.09 and gaps[1] >= 0.19  # 0.1 s, then 0.2 s
            assert [r.id for r in failed] == [rid]
            # the group's next run can be told
            fails = failed_since(db, "main", "2000-01-01T00:00:00.000Z")
            assert [r.id for r in fails] == [rid]
            assert failed_since(db, "main", row.updated_at) == []
            assert failed_since(db, "other") == []
            text = describe_failures(fails)
            assert "'hello'" in text and "502 bad gateway" in text and "fk:1" in text
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())


def test_permanent_error_fails_at_once_and_retry_after_is_honoured(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        ch.failures = [ChannelError("chat not found", permanent=True),
                       ChannelError("too many requests", retry_after=0.5)]
        w = OutboxWorker(db, [ch], policy=FAST)
        a = put(db, jid="fk:1")
        b = put(db, jid="fk:2")
        await w.run_once()
        ra, rb = get_row(db, a), get_row(db, b)
        assert ra.status == "failed" and ra.attempts == 1
        assert ra.last_error == "not retried: chat not found"
        assert rb.status == "pending"
        wait = w.next_due_in()
        assert 0.3 < wait <= 0.5  # the service's 0.5 s beats the policy's 0.1 s
        db.close()

    asyncio.run(main())


def test_order_within_a_chat_and_independence_across_chats(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        down = ScriptedChannel()
        down.jid_prefix = "dn:"
        down.connected = False  # this service is out
        w = OutboxWorker(db, [ch, down], policy=RetryPolicy(max_attempts=5, base_delay=60))
        d1 = put(db, jid="dn:1", text="one")
        d2 = put(db, jid="dn:1", text="two")
        u1 = put(db, jid="fk:1", text="up")
        nobody = put(db, jid="zz:1", text="lost")
        await w.run_once()
        assert ch.sent == [("fk:1", "up")] and status(db, u1) == "sent"
        r1 = get_row(db, d1)
        assert r1.status == "pending" and "not connected" in r1.last_error
        assert r1.attempts == 0  # an outage does not use up tries
        assert get_row(db, d2).attempts == 0  # waits behind the first of its chat
        for _ in range(20):  # however long the outage lasts
            with db.transaction() as c:
                c.execute("UPDATE outbox SET next_attempt_at = '2000-01-01T00:00:00.000Z'")
            await w.run_once()
        assert get_row(db, d1).status == "pending" and get_row(db, d1).attempts == 0
        assert get_row(db, nobody).status == "failed"  # no channel at all: tries run out
        assert "no channel serves zz:1" in get_row(db, nobody).last_error
        # outage over: both go out, in order
        down.connected = True
        with db.transaction() as c:
            c.execute("UPDATE outbox SET next_attempt_at = '2000-01-01T00:00:00.000Z' "
                      "WHERE id = ?", (d1,))
        await w.run_once()
        assert down.sent == [("dn:1", "one"), ("dn:1", "two")]
        db.close()

    asyncio.run(main())


def test_delivery_to_the_local_http_channel(tmp_path: Path) -> None:
    async def main() -> None:
        async with page_and_worker(tmp_path) as (db, http, w):
            rid = put(db, jid="hl:main", text="reply", sender="Andy")
            await w.run_once()
            assert status(db, rid) == "sent"
            assert [r["content"] for r in http.transcript("hl:main")] == ["reply"]

    asyncio.run(main())


def test_a_reply_to_the_local_http_channel_and_its_sent_mark_commit_together(
        tmp_path: Path) -> None:
    """The chat page's row of a reply and the reply's `sent` mark are one transaction:
    while the mark cannot be written, no row shows and the reply is tried again, so once
    it can be written the reply shows once; and a reply costs one transaction beside its
    claim (the page's row and the mark each had their own)."""
    async def main() -> None:
        async with page_and_worker(tmp_path) as (db, http, w):
            # The mark refused on the worker's connection (a TEMP trigger is its own).
            db.conn.execute(
                "CREATE TEMP TRIGGER no_mark BEFORE UPDATE OF status ON outbox "
                "WHEN NEW.status = 'sent' BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
            rid = put(db, jid="hl:main", text="reply", sender="Andy")
            await w.run_once()
            row = get_row(db, rid)
            assert row is not None
            assert (row.status, row.attempts) == ("pending", 1)
            assert "disk says no" in (row.last_error or "")
            assert http.transcript("hl:main") == []
            db.conn.execute("DROP TRIGGER no_mark")
            commits: list[str] = []
            db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT"
                                       else None)

            async def sent() -> bool:
                await w.run_once()  # nothing to do (no transaction) until its retry is due
                return status(db, rid) == "sent"

            await wait_until_async(sent, what="the reply sent on its second try")
            db.conn.set_trace_callback(None)
            assert [r["content"] for r in http.transcript("hl:main")] == ["reply"]
            assert len(commits) == 2  # the claim; the page's row with the mark
            await w.run_once()
            assert len(http.transcript("hl:main")) == 1

    asyncio.run(main())


def test_a_reply_longer_than_one_page_message_goes_in_parts_and_is_marked(
        tmp_path: Path) -> None:
    async def main() -> None:
        async with page_and_worker(tmp_path) as (db, http, w):
            http.max_message_length = 10
            rid = put(db, jid="hl:main", text="one two three four five", sender="Andy")
            await w.run_once()
            assert status(db, rid) == "sent"
            parts = [r["content"] for r in http.transcript("hl:main")]
            assert len(parts) > 1
            assert " ".join(p.strip() for p in parts) == "one two three four five"

    asyncio.run(main())


def test_the_chat_pages_replies_due_together_are_written_in_one_transaction(
        tmp_path: Path) -> None:
    """A chat page's texts claimed together are written with their `sent` marks in one
    transaction, in order; if it cannot be written, none is, the first counts a failed
    try and the others go back untried; the page keeps its limit across such writes."""
    async def main() -> None:
        async with page_and_worker(tmp_path, keep_per_chat=4) as (db, http, w):
            await http.send_message("hl:main", "earlier")  # the page knows its kept rows
            ids = [put(db, jid="hl:main", text=f"r{i}", sender="Andy") for i in range(6)]
            db.conn.execute(
                "CREATE TEMP TRIGGER no_mark BEFORE UPDATE OF status ON outbox "
                f"WHEN NEW.status = 'sent' AND OLD.id = {ids[2]} "
                "BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
            await w.run_once()
            rows = {r: get_row(db, r) for r in ids}
            assert [(rows[r].status, rows[r].attempts) for r in ids] == [  # type: ignore[union-attr]
                ("pending", 1)] + [("pending", 0)] * 5
            assert [r["content"] for r in http.transcript("hl:main")] == ["earlier"]
            db.conn.execute("DROP TRIGGER no_mark")
            commits: list[str] = []
            db.conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT"
                                       else None)

            async def sent() -> bool:
                await w.run_once()
                return all(status(db, r) == "sent" for r in ids)

            await wait_until_async(sent, what="the six replies sent")
            db.conn.set_trace_callback(None)
            assert len(commits) == 2  # the claim of the six; their rows and marks
            # The page keeps its newest 4, in order, and goes on keeping 4.
            assert [r["content"] for r in http.transcript("hl:main")] == ["r2", "r3", "r4",
                                                                           "r5"]
            await http.send_message("hl:main", "later")
            assert [r["content"] for r in http.transcript("hl:main")] == ["r3", "r4", "r5",
                                                                           "later"]
            assert db.scalar("SELECT count(*) FROM http_messages") == 4

    asyncio.run(main())


def worker_script(send_body: str) -> str:
    """A process running the outbox worker over the database in argv[1] with a fake chat
    service whose send_message(jid, text) runs `send_body` (indented 8 spaces); for the
    kill -9 tests."""
    return textwrap.dedent("""
        import asyncio, sys
        from mdclaw.channels.base import Channel
        from mdclaw.outbox import OutboxWorker
        from mdclaw.state import Database

        class Fake(Channel):
            name = "fake"; jid_prefix = "fk:"
            async def connect(self): pass
            async def disconnect(self): pass
            def is_connected(self): return True
            async def send_message(self, jid, text, **kw):
        %s
            async def send_file(self, *a, **kw): pass
            async def react(self, *a, **kw): pass
            async def set_typing(self, *a, **kw): pass

        async def main():
            w = OutboxWorker(Database(sys.argv[1]), [Fake()])
            await w.start()
            await asyncio.sleep(3600)

        asyncio.run(main())
    """) % textwrap.indent(textwrap.dedent(send_body).strip("\n"), " " * 8)


# Its send never returns.
CRASHING_WORKER = worker_script("""
    print("sending", flush=True)
    await asyncio.sleep(3600)
""")


def test_rows_left_sending_by_a_killed_process_are_sent_after_restart(tmp_path: Path) -> None:
    db_path = tmp_path / "s.db"
    db = Database(db_path)
    rid = put(db, text="survives")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WORKER, str(db_path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "sending"
        assert status(db, rid) == "sending"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status(db, rid) == "sending"

    async def main() -> None:
        ch = ScriptedChannel()
        w = OutboxWorker(db, [ch], policy=FAST)
        await w.start()
        try:
            await wait_until_async(lambda: status(db, rid) == "sent")
            assert ch.sent == [("fk:1", "survives")]
            assert get_row(db, rid).attempts == 2  # the interrupted try counts
        finally:
            await w.stop()

    asyncio.run(main())
    db.close()


def test_stop_leaves_no_row_sending(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        gate = asyncio.Event()
        orig = ch.send_message

        async def slow(jid, text, **kw):
            await gate.wait()
            return await orig(jid, text, **kw)

        ch.send_message = slow  # type: ignore[method-assign]
        w = OutboxWorker(db, [ch], policy=FAST)
        await w.start()
        rid = put(db)
        w.wake()
        await wait_until_async(lambda: status(db, rid) == "sending")
        await w.stop(timeout=0.2)
        assert status(db, rid) == "pending" and not w.running
        db.close()

    asyncio.run(main())


def test_a_cancelled_stop_passes_the_cancel_on_and_still_stops(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        gate = asyncio.Event()
        sending = asyncio.Event()
        orig = ch.send_message

        async def slow(jid, text, **kw):
            sending.set()
            await gate.wait()
            return await orig(jid, text, **kw)

        ch.send_message = slow  # type: ignore[method-assign]
        w = OutboxWorker(db, [ch], policy=FAST)
        await w.start()
        worker = w._task
        rid = put(db)
        w.wake()
        await sending.wait()
        stopping = asyncio.create_task(w.stop(timeout=3600))
        await asyncio.sleep(0)  # one step: stop() now waits for the send to finish
        assert not stopping.done()
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert worker is not None and worker.done()
        assert status(db, rid) == "pending" and not w.running
        db.close()

    asyncio.run(main())


def test_spooled_copies_are_removed_once_final(tmp_path: Path) -> None:
    from mdclaw.outbox import spool_cleaner

    spool = tmp_path / "spool" / "outbox"
    spool.mkdir(parents=True)
    mine = tmp_path / "keep.txt"
    mine.write_text("not in the spool")

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        clean = spool_cleaner(spool)
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=1, base_delay=0),
                         on_sent=clean, on_failed=clean)
        await w.start()
        try:
            ids = []
            for name in ("sent.txt", "failed.txt"):
                (spool / name).write_text(name)
            ids.append(put(db, kind="file", text=None, file_path=str(spool / "sent.txt")))
            ids.append(put(db, kind="file", text=None, file_path=str(mine)))
            w.wake()
            await wait_until_async(lambda: all(status(db, i) == "sent" for i in ids))
            ch.failures = [ChannelError("chat gone", permanent=True)]
            fid = put(db, kind="file", text=None, file_path=str(spool / "failed.txt"))
            w.wake()
            await wait_until_async(lambda: status(db, fid) == "failed")
        finally:
            await w.stop()
            db.close()

    asyncio.run(main())
    assert not (spool / "sent.txt").exists() and not (spool / "failed.txt").exists()
    assert mine.read_text() == "not in the spool"


# Answers at once (no wait on the network), except message 20, whose send hangs.
SLOW_ON_20 = worker_script("""
    print(text, flush=True)
    if text == "m20":
        await asyncio.sleep(3600)
""")


def test_kill_9_during_a_burst_sends_again_only_what_was_not_recorded(tmp_path: Path) -> None:
    """Rows are claimed in batches and marked sent together: after kill -9 every row still
    arrives, and what arrives twice is bounded (here the one send that was waiting)."""

    db_path = tmp_path / "s.db"
    db = Database(db_path)
    ids = [put(db, text=f"m{i}") for i in range(1, 51)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_ON_20, str(db_path)],
                            stdout=subprocess.PIPE, text=True, env=env)
    first: list[str] = []
    try:
        while not first or first[-1] != "m20":
            line = proc.stdout.readline()
            assert line, "the worker exited"
            first.append(line.strip())
        # m19's mark follows the wait of m20's send
        wait_until(lambda: status(db, ids[18]) == "sent", 10, what="m19 marked sent")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first == [f"m{i}" for i in range(1, 21)]

    async def main() -> None:
        ch = ScriptedChannel()
        w = OutboxWorker(db, [ch], policy=FAST)
        await w.start()
        try:
            await wait_until_async(lambda: outbox_counts(db)["sent"] == 50)
        finally:
            await w.stop()
        again = [t for _, t in ch.sent]
        assert again == [f"m{i}" for i in range(20, 51)]  # in order; only m20 twice
        assert len(set(first) & set(again)) <= BATCH

    asyncio.run(main())
    db.close()


def test_a_failed_send_puts_the_rest_of_its_batch_back_untried(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch = ScriptedChannel()
        a, b, c = (put(db, text=t) for t in ("a", "b", "c"))
        orig = ch.send_message

        async def second_fails(jid, text, **kw):
            if text == "b" and get_row(db, b).attempts == 1:
                raise ChannelError("502 bad gateway")
            return await orig(jid, text, **kw)

        ch.send_message = second_fails  # type: ignore[method-assign]
        w = OutboxWorker(db, [ch], policy=FAST)
        await w.run_once()
        assert ch.sent == [("fk:1", "a")]
        ra, rb, rc = get_row(db, a), get_row(db, b), get_row(db, c)
        assert (ra.status, ra.attempts) == ("sent", 1)
        assert (rb.status, rb.attempts) == ("pending", 1)
        assert (rc.status, rc.attempts) == ("pending", 0)  # claimed, never tried: not counted
        await asyncio.sleep(0.15)
        await w.run_once()
        assert [t for _, t in ch.sent] == ["a", "b", "c"]
        assert get_row(db, c).attempts == 1
        db.close()

    asyncio.run(main())


def test_deliveries_whose_marks_could_not_be_written_are_recorded_and_the_chat_goes_on(
        tmp_path: Path) -> None:
    """The database is locked by another writer when a burst's `sent` marks and next claim
    are written: the marks are written once it is free again (not only at stop), and the
    rest of the chat is then delivered, each row once."""
    import sqlite3

    async def main() -> None:
        db = Database(tmp_path / "s.db", timeout=0.2)
        ch = ScriptedChannel()
        ids = [put(db, text=f"m{i}") for i in range(20)]
        other = sqlite3.connect(str(tmp_path / "s.db"), isolation_level=None)
        orig = ch.send_message

        async def lock_after_16th(jid, text, **kw):
            r = await orig(jid, text, **kw)
            if text == "m15":  # the last of the first batch: its next claim meets the lock
                other.execute("BEGIN IMMEDIATE")
                asyncio.get_running_loop().call_later(0.5, other.execute, "COMMIT")
            return r

        ch.send_message = lock_after_16th  # type: ignore[method-assign]
        w = OutboxWorker(db, [ch], policy=FAST, max_idle=30)
        await w.start()
        try:
            await wait_until_async(lambda: status(db, ids[-1]) == "sent", timeout=10)
            assert [t for _, t in ch.sent] == [f"m{i}" for i in range(20)]
            assert outbox_counts(db)["sent"] == 20
        finally:
            await w.stop()
            other.close()
            db.close()

    asyncio.run(main())


# ---------------------------------------------------------------------- a burst's pace


class Turns:
    """Counts turns of the event loop: a task that yields once a turn (as the IPC loop does
    between rounds), so a delivery that waits a turn waits for it."""

    def __init__(self) -> None:
        self.n = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.n += 1



def unmarked_at_each_send(ch: ScriptedChannel, db: Database) -> list[int]:
    """Wraps `ch`'s send_message: the list gets, as each message goes, how many rows were
    delivered before it and are not yet marked `sent`."""
    unmarked: list[int] = []
    orig = ch.send_message

    async def send(jid, text, **kw):  # noqa: ANN001, ANN003, ANN202
        unmarked.append(len(ch.sent) - outbox_counts(db)["sent"])
        return await orig(jid, text, **kw)

    ch.send_message = send  # type: ignore[method-assign]
    return unmarked

def test_a_flooded_chat_is_delivered_without_a_turn_of_the_loop_per_batch(
        tmp_path: Path) -> None:
    """A chat with many rows due and a chat service that answers at once: after its first
    claim, the drain writes each next claim (with the marks of the batch it delivered) at
    once, instead of waiting turns of the loop (each of which may be a whole IPC round) for
    every BATCH rows; the per-chat bound on unmarked rows still holds."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ids = [put(db, text=f"m{i}") for i in range(5 * BATCH)]
        ch = ScriptedChannel()
        w = OutboxWorker(db, [ch], policy=FAST)
        unmarked = unmarked_at_each_send(ch, db)
        turns = Turns()
        try:
            await w.run_once()
            took = turns.n
        finally:
            turns.task.cancel()
        assert [t for _, t in ch.sent] == [f"m{i}" for i in range(5 * BATCH)]
        assert all(status(db, i) == "sent" for i in ids)
        assert max(unmarked) <= BATCH
        assert took <= 4, took  # 12 when each claim took two turns
        db.close()

    asyncio.run(main())


def test_chats_waiting_for_their_claims_do_not_hold_places_among_the_senders(
        tmp_path: Path) -> None:
    """More chats than `max_parallel_chats`, a chat service that answers at once: every
    chat's claim is written in one transaction and every chat is delivered in the next
    turn (a chat waiting for its claim to be written held a place among the chats sending,
    so the others went max_parallel_chats at a time, two turns each)."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        for c in range(12):
            for i in range(3):
                put(db, jid=f"fk:{c}", text=f"c{c}m{i}")
        ch = ScriptedChannel()
        w = OutboxWorker(db, [ch], policy=FAST, max_parallel_chats=2)
        flushes = 0
        orig_flush = w._flush

        def counting_flush() -> None:
            nonlocal flushes
            if w._claims:
                flushes += 1
            orig_flush()

        w._flush = counting_flush  # type: ignore[method-assign]
        turns = Turns()
        try:
            await w.run_once()
            took = turns.n
        finally:
            turns.task.cancel()
        assert outbox_counts(db)["sent"] == 36
        for c in range(12):  # each chat in order
            assert [t for j, t in ch.sent if j == f"fk:{c}"] == [f"c{c}m{i}" for i in range(3)]
        assert flushes == 1, flushes  # 6 when the chats went two at a time
        assert took <= 4, took  # 19 when the chats went two at a time
        db.close()

    asyncio.run(main())


def test_a_slow_chat_service_still_gets_one_send_per_chat_and_at_most_the_parallel_chats(
        tmp_path: Path) -> None:
    """Sends that wait on the network: one at a time within a chat, in order, and at most
    `max_parallel_chats` chats at once."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        for c in range(5):
            for i in range(4):
                put(db, jid=f"fk:{c}", text=f"c{c}m{i}")
        ch = ScriptedChannel()
        in_flight: dict[str, int] = {}
        most = {"all": 0, "chat": 0}
        orig = ch.send_message

        async def slow(jid, text, **kw):  # noqa: ANN001, ANN003, ANN202
            in_flight[jid] = in_flight.get(jid, 0) + 1
            most["all"] = max(most["all"], sum(in_flight.values()))
            most["chat"] = max(most["chat"], in_flight[jid])
            try:
                await asyncio.sleep(0.002)
                return await orig(jid, text, **kw)
            finally:
                in_flight[jid] -= 1

        ch.send_message = slow  # type: ignore[method-assign]
        w = OutboxWorker(db, [ch], policy=FAST, max_parallel_chats=2)
        await w.start()
        try:
            await wait_until_async(lambda: outbox_counts(db)["sent"] == 20, timeout=10)
        finally:
            await w.stop()
        for c in range(5):
            assert [t for j, t in ch.sent if j == f"fk:{c}"] == [f"c{c}m{i}" for i in range(4)]
        assert most == {"all": 2, "chat": 1}
        db.close()

    asyncio.run(main())


def test_unmarked_deliveries_are_bounded_in_all(tmp_path: Path) -> None:
    """Many chats delivered in one turn by a chat service that answers at once: their
    `sent` marks are written before more than MARKS_MAX wait for their flush."""

    async def main() -> None:
        db = Database(tmp_path / "s.db")
        n = MARKS_MAX * 2 + 5
        for c in range(n):
            put(db, jid=f"fk:{c}", text=f"c{c}")
        ch = ScriptedChannel()
        unmarked = unmarked_at_each_send(ch, db)
        w = OutboxWorker(db, [ch], policy=FAST, max_parallel_chats=n)
        await w.run_once()
        assert outbox_counts(db)["sent"] == n
        assert max(unmarked) <= MARKS_MAX
        assert max(unmarked) >= MARKS_MAX - 1  # they did pile up in one turn
        db.close()

    asyncio.run(main())
