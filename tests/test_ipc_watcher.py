"""The IPC loop with real inotify (and with polling only), the daemon in a subprocess, and
the CLI commands."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from conftest import REPO
from ipc_helpers import Env, schedule_body
from mdclaw.ipc import files as files_mod
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.state import Database
from waiting import wait_until, wait_until_async


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


async def _took(cond: Callable[[], bool], timeout: float = 5.0) -> float:
    """Seconds until `cond()` holds, looked at every 2 ms (these tests time the wake-up)."""
    t0 = time.monotonic()
    await wait_until_async(cond, timeout, interval=0.002)
    return time.monotonic() - t0


def run_loop(env: Env, body: Callable[[IpcWatcher], Awaitable[None]], **kw) -> IpcWatcher:  # noqa: ANN003
    async def main() -> IpcWatcher:
        stop = asyncio.Event()
        w = IpcWatcher(env.cfg, env.db, **kw)
        task = asyncio.create_task(w.run(stop))
        try:
            await wait_until_async(lambda: w.idle.is_set())
            await body(w)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
            w.close()
        return w

    return asyncio.run(main())


def test_inotify_wakes_the_loop_long_before_the_poll(env: Env) -> None:
    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        for i in range(20):
            env.write("family", {"type": "message", "text": f"m{i}"}, sub="messages")
            took = await _took(lambda n=i + 1: len(env.outbox()) == n, timeout=10)
            assert took < 5.0  # the poll is 30 s away
        env.write("work", schedule_body("w1"))
        await wait_until_async(lambda: env.task("w1") is not None, timeout=10)

    w = run_loop(env, body, poll_interval=30)
    assert w.totals.applied == 21


def test_polling_alone_is_correct(env: Env) -> None:
    async def body(w: IpcWatcher) -> None:
        assert w.inotify is None
        for g in ("family", "work", "main"):
            env.write(g, {"type": "message", "text": g}, sub="messages")
        env.write("family", schedule_body("p1"))
        await wait_until_async(lambda: len(env.outbox()) == 3 and env.task("p1") is not None)

    run_loop(env, body, use_inotify=False, poll_interval=0.05)


def test_swapped_dir_while_running_is_refused_then_rewatched(env: Env, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tasks = env.ipc / "family" / "tasks"

    async def body(w: IpcWatcher) -> None:
        os.rename(tasks, env.ipc / "family" / "tasks.old")
        os.symlink(elsewhere, tasks)
        (elsewhere / "evil.json").write_text(json.dumps(schedule_body("evil")))
        env.write("family", {"type": "message", "text": "alive"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 1)
        await asyncio.sleep(0.1)
        assert env.task("evil") is None and (elsewhere / "evil.json").exists()
        # put a real folder back: it is watched again (the poll is 30 s away)
        os.unlink(tasks)
        os.mkdir(tasks)
        await asyncio.sleep(0.05)
        env.write("family", schedule_body("back"))
        await wait_until_async(lambda: env.task("back") is not None, timeout=10)

    with caplog.at_level(logging.WARNING, logger="mdclaw.ipc"):
        run_loop(env, body, poll_interval=30)
    assert "ipc/family/tasks is a symlink, not a directory; refused" in caplog.text


def test_group_registered_over_ipc_is_watched_at_once(env: Env) -> None:
    async def body(w: IpcWatcher) -> None:
        env.write("main", {"type": "register_group", "jid": "tg:9", "name": "G",
                           "folder": "garden"}, sub="groups")
        await wait_until_async(lambda: (env.ipc / "garden" / "messages").is_dir())
        await asyncio.sleep(0.05)
        env.write("garden", {"type": "message", "text": "from garden"}, sub="messages")
        await wait_until_async(lambda: any(r["text"] == "from garden" for r in env.outbox()),
                               timeout=10)

    run_loop(env, body, poll_interval=30)


def test_hostile_files_do_not_stop_the_loop(env: Env) -> None:
    async def body(w: IpcWatcher) -> None:
        tasks = env.ipc / "family" / "tasks"
        os.mkfifo(tasks / "fifo.json")
        (tasks / "deep.json").write_bytes(b"[" * 100_000)
        old = time.time_ns() - 5 * 10 ** 9
        os.utime(tasks / "deep.json", ns=(old, old))  # settled: not still being written
        with open(tasks / "huge.json", "wb") as f:
            f.truncate(2 * 1024 ** 3)
        env.write("family", {"type": "message", "text": "after"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 1)
        await wait_until_async(lambda: all(env.errors_for("family", n) for n in
                                           ("fifo.json", "deep.json", "huge.json")), timeout=3)

    run_loop(env, body, poll_interval=0.2)


def test_a_flood_from_one_group_does_not_starve_another(tmp_path: Path) -> None:
    e = Env(tmp_path)
    try:
        for i in range(3000):
            e.write("family", {"type": "message", "text": f"flood {i}"}, sub="messages")

        async def main() -> None:
            stop = asyncio.Event()
            w = IpcWatcher(e.cfg, e.db, poll_interval=30)
            w.engine.batch_per_group = 16
            task = asyncio.create_task(w.run(stop))
            await wait_until_async(lambda: len(e.outbox()) > 0)
            e.write("work", {"type": "message", "text": "quiet"}, sub="messages")
            await wait_until_async(lambda: any(r["text"] == "quiet" for r in e.outbox()))
            done_flood = sum(1 for r in e.outbox() if r["text"].startswith("flood"))
            assert done_flood < 3000  # served while the flood was still going
            await wait_until_async(lambda: len(e.outbox()) == 3001, timeout=30)
            stop.set()
            await task
            w.close()

        asyncio.run(main())
    finally:
        e.close()


# --------------------------------------------------------------------------- subprocesses

def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def test_mdclaw_run_applies_commands_until_sigterm(env: Env) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config",
                             str(env.config_path)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        snap = env.ipc / "family" / "current_tasks.json"
        wait_until(snap.exists, 20, what="the daemon's task snapshot")
        env.write("family", schedule_body("from-daemon"))
        env.write("family", {"type": "message", "text": "hello"}, sub="messages")
        wait_until(lambda: env.task("from-daemon") is not None and env.outbox(), 20,
                   what="the daemon to apply both files")
        assert env.task("from-daemon") is not None and env.outbox()[0]["text"] == "hello"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "ipc: watching" in err


def test_cli_drain_errors_outbox(env: Env, cli) -> None:  # noqa: ANN001
    cfg = str(env.config_path)
    env.write("family", {"type": "message", "text": "one"}, sub="messages")
    env.write("family", {"type": "message", "chatJid": "tg:1", "text": "not yours"},
              sub="messages")
    env.write("work", schedule_body("cli-task"))
    r = cli("ipc", "drain", "--json", "--config", cfg)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"applied": 2, "rejected": 1, "pending": 0}
    r = cli("ipc", "drain", "--config", cfg)
    assert r.stdout.strip() == "applied 0, rejected 0, pending 0"
    r = cli("ipc", "errors", "--json", "--config", cfg)
    errors = json.loads(r.stdout)
    assert len(errors) == 1
    assert set(errors[0]) == {"name", "original_file", "source_group", "error",
                              "processed_at"}
    assert errors[0]["source_group"] == "family" and "own chat" in errors[0]["error"]
    table = cli("ipc", "errors", "--config", cfg).stdout
    assert table.splitlines()[0].split() == ["NAME", "SOURCE_GROUP", "ORIGINAL_FILE", "ERROR",
                                             "PROCESSED_AT"]
    r = cli("outbox", "list", "--json", "--config", cfg)
    rows = json.loads(r.stdout)
    next_try = rows[0].pop("next_attempt_at")
    assert rows == [{"id": 1, "chat_jid": "tg:2", "kind": "text", "text": "one",
                     "status": "pending", "source_group": "family", "attempts": 0,
                     "last_error": None}]
    assert next_try.endswith("Z")
    assert cli("outbox", "list", "--status", "sent", "--json", "--config",
               cfg).stdout.strip() == "[]"
    assert "ID" in cli("outbox", "list", "--config", cfg).stdout


def test_changes_made_elsewhere_reach_the_snapshots_within_a_poll(env: Env) -> None:
    env.write("family", schedule_body("ext"))
    env.drain()

    async def body(w: IpcWatcher) -> None:
        snap = env.ipc / "family" / "current_tasks.json"
        assert json.loads(snap.read_text())[0]["status"] == "active"
        # another process (the CLI, the scheduler) pauses the task and a channel meets a chat
        other = Database(env.cfg.db_path)
        with other.transaction() as c:
            c.execute("UPDATE scheduled_tasks SET status = 'paused', updated_at = "
                      "'2099-01-01T00:00:00.000Z' WHERE id = 'ext'")
            c.execute("INSERT INTO chats (jid, name, last_activity) VALUES "
                      "('tg:55', 'New chat', '2026-01-01T00:00:00.000Z')")
        other.close()
        await wait_until_async(lambda: json.loads(snap.read_text())[0]["status"] == "paused",
                               3)
        groups = env.ipc / "main" / "available_groups.json"
        await wait_until_async(lambda: any(g["jid"] == "tg:55" for g in
                                           json.loads(groups.read_text())["groups"]), 3)

    run_loop(env, body, poll_interval=0.1)


def test_the_poll_finds_what_inotify_did_not_report(env: Env, tmp_path: Path) -> None:
    """A file that appears without close-after-write or moved-to (here: a hard link made
    and the original removed, which only raises IN_CREATE) is still found by the poll (here
    every group is looked at within 0.5 s; by default within SAFETY_RESCAN)."""
    staging = env.ipc / "family" / "staging"
    staging.mkdir()

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        src = staging / "cmd.json"
        src.write_text(json.dumps({"type": "message", "text": "silent"}))
        os.link(src, env.ipc / "family" / "messages" / "silent.json")
        os.unlink(src)  # inotify reported only IN_CREATE, which does not wake the loop
        took = await _took(lambda: len(env.outbox()) == 1, timeout=10)
        assert took < 5  # the default rescan (SAFETY_RESCAN) would take 30 s

    run_loop(env, body, poll_interval=0.5, safety_rescan=0.5)


def test_a_lost_event_is_found_by_the_rotation_and_a_tick_looks_at_a_slice(
        tmp_path: Path) -> None:
    """With inotify healthy a poll tick looks at ceil(groups * interval / safety_rescan)
    groups, never all of them; a command whose event was lost is found within
    `safety_rescan` all the same."""
    e = Env(tmp_path, extra_groups=27)  # 30 groups

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None and not w._unwatched  # noqa: SLF001
        seen: list[list[str]] = [w.poll_targets() for _ in range(10)]
        assert all(len(t) == 3 for t in seen)  # 30 groups, 10 ticks per rescan
        assert {f for t in seen for f in t} == set(w.engine.dirs)
        e.write("family", {"type": "message", "text": "lost"}, sub="messages")
        assert w.inotify.read(timeout=0)  # read here: the loop never hears of the file
        took = await _took(lambda: len(e.outbox()) == 1, timeout=5)
        assert took < 2.5  # one rescan (1 s) plus a tick, with room for a loaded machine

    try:
        run_loop(e, body, poll_interval=0.1, safety_rescan=1.0)
    finally:
        e.close()


def test_a_trickle_is_taken_from_the_names_inotify_reported_without_listing(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a folder was listed under its watch, a command arriving alone is read by the name
    its event gave: the folder is not listed again for each one (the listing was a tenth of
    a lone command's cost), nor are it and its group's folder looked up again (their
    watches report a swap, which the watcher re-checks before its next round)."""
    listings: list[int] = []
    lookups: list[str] = []
    real = files_mod.agentfs.listdir
    real_lstat = files_mod.agentfs.lstat

    def counting(fd: int) -> list[str]:
        listings.append(fd)
        return real(fd)

    def looking(dir_fd: int, name: str) -> os.stat_result | None:
        lookups.append(name)
        return real_lstat(dir_fd, name)

    monkeypatch.setattr(files_mod.agentfs, "listdir", counting)
    monkeypatch.setattr(files_mod.agentfs, "lstat", looking)

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        env.write("family", {"type": "message", "text": "first"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 1)
        before, looked = len(listings), len(lookups)
        for i in range(20):
            env.write("family", {"type": "message", "text": f"m{i}"}, sub="messages")
            await wait_until_async(lambda n=i + 2: len(env.outbox()) == n)
        assert len(listings) == before  # twenty commands, no listing
        assert lookups[looked:] == []  # and no folder looked up again

    run_loop(env, body, poll_interval=3600, safety_rescan=3600)
    assert [r["text"] for r in env.outbox()] == ["first"] + [f"m{i}" for i in range(20)]


def test_a_folder_swapped_for_another_is_looked_up_before_names_from_it_count(
        env: Env) -> None:
    """A folder listed under its watch is swapped for another real one (renamed away, a new
    one made): a command written into the old one after the swap is named by the old
    folder's watch, but the watcher looks the folder up again first (its watch reported the
    move), so that command is not taken from the old folder, and the new folder's are."""
    messages = env.ipc / "family" / "messages"
    old = env.ipc / "family" / "messages.old"

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        env.write("family", {"type": "message", "text": "first"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 1)  # listed under its watch
        os.rename(messages, old)
        os.mkdir(messages)
        (old / ".x.json.tmp").write_text(json.dumps({"type": "message", "text": "stale"}))
        os.rename(old / ".x.json.tmp", old / "x.json")
        env.write("family", {"type": "message", "text": "new"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 2, timeout=5)
        env.write("family", {"type": "message", "text": "after"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 3, timeout=5)

    run_loop(env, body, poll_interval=3600, safety_rescan=3600)
    assert [r["text"] for r in env.outbox()] == ["first", "new", "after"]
    assert (old / "x.json").exists()


def test_a_folder_watched_anew_is_listed_before_its_names_are_trusted(env: Env) -> None:
    """The kernel dropped a folder's watch (IN_IGNORED; here rm_watch): files that came
    while it was unwatched raised no event. Once the watch is placed again, the next round
    lists the folder instead of trusting only the new names, so they are not left for the
    rotation (an hour away here)."""
    messages = env.ipc / "family" / "messages"
    staging = env.ipc / "family" / "staging"
    staging.mkdir()

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        env.write("family", {"type": "message", "text": "first"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 1)  # listed under its watch
        old_wd = w._watched[("family", "messages")][0]  # noqa: SLF001
        w.inotify.rm_watch(old_wd)
        # While nothing watches the folder (the loop runs none of this until the await):
        (staging / "a.json").write_text(json.dumps({"type": "message", "text": "unseen a"}))
        os.link(staging / "a.json", messages / "a.json")
        os.unlink(staging / "a.json")
        env.write("family", {"type": "message", "text": "unseen b"}, sub="messages")
        await wait_until_async(lambda: w._watched.get(("family", "messages"),  # noqa: SLF001
                                                      (old_wd,))[0] != old_wd)
        env.write("family", {"type": "message", "text": "seen c"}, sub="messages")
        await wait_until_async(lambda: len(env.outbox()) == 4, timeout=5)

    run_loop(env, body, poll_interval=3600, safety_rescan=3600)
    assert sorted(r["text"] for r in env.outbox()) == ["first", "seen c", "unseen a",
                                                       "unseen b"]


def test_inotify_queue_overflow_triggers_a_full_scan(env: Env) -> None:
    """More events than the kernel queues (fs.inotify.max_queued_events) while the loop is
    busy: the event for the real command is lost, IN_Q_OVERFLOW arrives instead, and the loop
    scans every folder at once (the poll is an hour away)."""
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    messages = env.ipc / "family" / "messages"

    async def body(w: IpcWatcher) -> None:
        assert w.inotify is not None
        noise = env.ipc / "family" / "noise"
        noise.mkdir()
        # The loop cannot read events while this runs: the kernel queue fills and overflows.
        # (Distinct names: the kernel merges an event identical to the one queued last.)
        for i in range(limit + 2000):
            fd = os.open(noise / f"n{i}", os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            os.rename(noise / f"n{i}", messages / f".n{i}")  # IN_MOVED_TO, then ignored
        env.write("family", {"type": "message", "text": "after the flood"}, sub="messages")
        for i in range(limit + 2000):
            os.unlink(messages / f".n{i}")
        took = await _took(lambda: len(env.outbox()) == 1, timeout=10)
        assert took < 5

    with caplog_for("mdclaw.ipc") as records:
        run_loop(env, body, poll_interval=3600)
    assert any("overflowed" in r.getMessage() for r in records)


class caplog_for:  # noqa: N801 - used as a context manager
    """Collect the records of one logger (pytest's caplog does not reach into asyncio.run
    callbacks any differently; this keeps the test self-contained)."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append  # type: ignore[method-assign]

    def __enter__(self) -> list[logging.LogRecord]:
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
