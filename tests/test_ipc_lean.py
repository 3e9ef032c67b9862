"""The IPC loop's lean paths: a round's metrics bumped once, its plain BEGIN/COMMIT, the
snapshot thread's WAL checkpoints by size, a round run from the inotify callback."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from ipc_helpers import Env
from mdclaw.ipc import writers
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.metrics import observe_many
from mdclaw.paths import Layout
from mdclaw.state import Database
from waiting import wait_until, wait_until_async


def _series(registry: CollectorRegistry, name: str) -> list[str]:
    return [line.split(name, 1)[1] for line in generate_latest(registry).decode().splitlines()
            if line.startswith(name) and "_created" not in line]


def test_observe_many_is_n_observations() -> None:
    reg = CollectorRegistry()
    many = Histogram("many", "m", buckets=(0.001, 0.01, 1.0), registry=reg)
    one = Histogram("one", "o", buckets=(0.001, 0.01, 1.0), registry=reg)
    for amount, n in ((0.0005, 3), (0.005, 1), (0.5, 4), (7.0, 2), (0.01, 5), (0.2, 0)):
        observe_many(many, amount, n)
        for _ in range(n):
            one.observe(amount)
    many_s, one_s = _series(reg, "many"), _series(reg, "one")
    assert [x for x in many_s if "_sum" not in x] == [x for x in one_s if "_sum" not in x]
    sums = [float(x.split()[1]) for x in many_s + one_s if x.startswith("_sum")]
    assert sums[0] == pytest.approx(sums[1]) and sums[0] == pytest.approx(16.0565)
    assert "_count 15.0" in many_s


def test_begin_end_commits_rolls_back_and_releases_the_lock(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    conn = db.begin()
    conn.execute("INSERT INTO router_state (key, value) VALUES ('a', '1')")
    inner = db.begin()  # nested: joins the outer transaction
    inner.execute("INSERT INTO router_state (key, value) VALUES ('b', '2')")
    db.end(commit=True)
    assert conn.in_transaction
    db.end(commit=True)
    assert not conn.in_transaction
    conn = db.begin()
    conn.execute("INSERT INTO router_state (key, value) VALUES ('c', '3')")
    db.end(commit=False)
    assert [r[0] for r in db.query("SELECT key FROM router_state ORDER BY key")] == ["a", "b"]
    # The lock is free again: another thread gets its transaction.
    done = threading.Event()

    def other() -> None:
        with db.transaction() as c:
            c.execute("INSERT INTO router_state (key, value) VALUES ('d', '4')")
        done.set()

    threading.Thread(target=other).start()
    assert done.wait(5)
    db.close()


def test_wal_frames_are_what_sqlite_counts(tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")
    try:
        with db.transaction() as conn:
            conn.executemany("INSERT INTO router_state (key, value) VALUES (?, ?)",
                             [(f"k{i}", "x" * 3000) for i in range(40)])
        frames, done = db.wal_frames() or (-1, -1)
        busy, log, ckpt = db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert (busy, frames, done) == (0, log, 0) and log > 40
        assert db.wal_frames() == (log, ckpt)
    finally:
        db.close()
    assert not os.path.exists(f"{db.path}-shm")  # the last connection removed it
    assert db.wal_frames() is None  # no -shm file to read


def test_the_snapshot_thread_folds_the_wal_in_once_writes_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writers, "CHECKPOINT_IDLE", 0.2)
    db = Database(tmp_path / "state.db")
    db.set_autocheckpoint(0)  # only the thread checkpoints here
    snap = writers.SnapshotWriter(db.path, Layout(tmp_path / "data"))
    try:
        with db.transaction() as conn:
            conn.executemany("INSERT INTO router_state (key, value) VALUES (?, ?)",
                             [(f"k{i}", "x" * 3000) for i in range(20)])
        frames, done = db.wal_frames() or (0, 0)
        assert frames > 20 and done == 0  # under CHECKPOINT_FRAMES: nothing yet
        wait_until(lambda: db.wal_frames() == (frames, frames),
                   what="the idle WAL checkpointed by the snapshot thread")
    finally:
        snap.close()
        db.close()


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


def test_a_round_run_from_the_inotify_callback_fails_run(env: Env) -> None:
    """A round the reader callback runs (run() asleep) that raises ends run() with that
    error, as a round run() runs itself would; one that works is applied and sets nothing
    running in run() meanwhile."""

    async def main() -> None:
        stop = asyncio.Event()
        w = IpcWatcher(env.cfg, env.db, poll_interval=30.0)  # no poll tick meanwhile
        task = asyncio.create_task(w.run(stop))
        try:
            await wait_until_async(lambda: w.idle.is_set())
            calls: list[int] = []
            process = w.engine.process

            def counted(batch):  # noqa: ANN001, ANN202
                calls.append(1)
                return process(batch)

            w.engine.process = counted  # type: ignore[method-assign]
            await wait_until_async(lambda: w._waiter is not None)
            asleep = w._waiter
            env.write("family", {"type": "message", "text": "hi"}, sub="messages")
            await wait_until_async(lambda: w.totals.applied == 1)
            assert w._waiter is asleep and not asleep.done()  # run() slept through it

            def broken(batch):  # noqa: ANN001, ANN202
                raise sqlite3.OperationalError("disk I/O error")

            w.engine.process = broken  # type: ignore[method-assign]
            env.write("family", {"type": "message", "text": "again"}, sub="messages")
            with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
                await asyncio.wait_for(task, 5)
            assert calls == [1]
        finally:
            stop.set()
            if not task.done():
                await asyncio.wait_for(task, 5)
            w.close()

    asyncio.run(main())


def test_the_snapshot_thread_is_told_while_rounds_follow_each_other(env: Env) -> None:
    """The index batch waits for the end of a burst (SnapshotWriter's `busy`): the watcher
    says so while a round left more pending, and no longer once it has caught up."""
    per_round = 8
    for i in range(3 * per_round + 1):
        env.write("family", {"type": "message", "text": f"m{i}"}, sub="messages")

    async def main() -> None:
        stop = asyncio.Event()
        w = IpcWatcher(env.cfg, env.db, poll_interval=30.0)
        w.engine.batch_per_group = per_round
        busy = w.snapshot_writer.busy
        assert busy is not None and not busy()
        seen: list[bool] = []
        process = w.engine.process

        def watched(batch):  # noqa: ANN001, ANN202
            seen.append(busy())
            return process(batch)

        w.engine.process = watched  # type: ignore[method-assign]
        task = asyncio.create_task(w.run(stop))
        try:
            await wait_until_async(lambda: w.totals.applied == 3 * per_round + 1)
            await wait_until_async(lambda: w.idle.is_set())
            # The first round found the backlog; each one after it was told of more.
            assert seen[0] is False and seen[1:] == [True] * (len(seen) - 1)
            assert len(seen) >= 4
            assert not busy()
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
            w.close()

    asyncio.run(main())
