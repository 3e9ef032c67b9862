"""The notify messages reach a real NOTIFY_SOCKET; the watchdog stops on a stale probe."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from mdclaw.systemd import Notifier, watchdog_interval
from waiting import wait_until


def listen(tmp_path, monkeypatch) -> socket.socket:
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    return s


def test_messages_arrive(tmp_path, monkeypatch) -> None:
    s = listen(tmp_path, monkeypatch)
    n = Notifier()
    n.ready("serving 2 groups")
    n.reloading()
    n.stopping()
    got = [s.recv(4096).decode() for _ in range(3)]
    assert got[0] == "READY=1\nSTATUS=serving 2 groups"
    assert got[1].startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert got[2] == "STOPPING=1"


def test_watchdog_interval_from_env(monkeypatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    assert watchdog_interval() == 5.0
    monkeypatch.setenv("WATCHDOG_PID", "1")  # meant for another process
    assert watchdog_interval() is None


def test_watchdog_pings_only_with_progress(tmp_path, monkeypatch) -> None:
    s = listen(tmp_path, monkeypatch)
    s.setblocking(False)
    n = Notifier()
    last = {"t": time.monotonic()}
    n.add_probe("ipc", lambda: last["t"])

    def drain() -> list[bytes]:
        got = []
        with contextlib.suppress(BlockingIOError):
            while True:
                got.append(s.recv(100))
        return got

    async def main() -> tuple[list[bytes], list[bytes]]:
        task = asyncio.create_task(n.watchdog_loop(interval=0.05))
        before: list[bytes] = []
        deadline = time.monotonic() + 10
        while len(before) < 2 and time.monotonic() < deadline:  # fresh: it pings
            await asyncio.sleep(0.01)
            last["t"] = time.monotonic()
            before += drain()
        before += drain()
        # The component stops making progress (no await in between: no ping is under way).
        last["t"] = time.monotonic() - 100
        await asyncio.sleep(0.3)  # six intervals in which no ping may come
        task.cancel()
        return before, drain()

    before, after = asyncio.run(main())
    assert len(before) >= 2 and all(p == b"WATCHDOG=1" for p in before)
    assert after == []


def test_daemon_pings_the_watchdog_while_its_loops_run(tmp_path, write_config) -> None:
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    sock_path = tmp_path / "n.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(sock_path))
    s.settimeout(0.5)
    cfg = write_config("data_dir: {data_dir}\ngroups: {}\nchannels: {http: {enabled: false}}\n"
                       f"runtime: {{socket: 'unix://{tmp_path}/none.sock'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(PYTHONPATH=str(REPO), NOTIFY_SOCKET=str(sock_path), WATCHDOG_USEC="1000000")
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    got: list[str] = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and got.count("WATCHDOG=1") < 4:
            try:
                got.extend(s.recv(4096).decode().splitlines())
            except TimeoutError:
                pass
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    states = [g for g in got if g in ("READY=1", "WATCHDOG=1")]
    assert "READY=1" in states, got
    assert states.count("WATCHDOG=1") >= 4, got


def test_watchdog_counts_an_idle_scheduler_alive_and_a_stuck_one_not(tmp_path,
                                                                     monkeypatch) -> None:
    """The daemon's scheduler sleeps until its next due time (no 1 s tick). Asleep with its
    deadline ahead is progress however long it lasts; a round stuck (here: on a write lock
    another connection holds) is not, and the pings stop until it moves again."""
    import threading
    from datetime import timedelta

    from mdclaw import schedule
    from mdclaw.scheduler import Scheduler
    from mdclaw.state import Database
    from mdclaw.state.tasks import insert_task, update_task_fields

    s = listen(tmp_path, monkeypatch)
    s.setblocking(False)
    db = Database(tmp_path / "state.db")
    ran: list[str] = []

    async def execute(task) -> None:  # noqa: ANN001
        ran.append(task.id)

    sched = Scheduler(db, execute, max_sleep=30)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(sched.run(),))
    thread.start()
    n = Notifier()
    n.add_probe("scheduler", sched.alive_at)

    def pings_during(seconds: float, *, enough: int | None = None) -> int:
        """Pings in `seconds`; with `enough`, until that many came (at most 10 s)."""
        got = 0

        def drain() -> None:  # read as they come: a full datagram queue would block the send
            nonlocal got
            with contextlib.suppress(BlockingIOError):
                while True:
                    got += s.recv(100) == b"WATCHDOG=1"

        async def main() -> None:
            task = asyncio.create_task(n.watchdog_loop(interval=0.05))  # stale after 0.1 s
            end = time.monotonic() + (10 if enough else seconds)
            while time.monotonic() < end and not (enough and got >= enough):
                drain()
                await asyncio.sleep(0.01)
            task.cancel()

        asyncio.run(main())
        drain()
        return got

    blocker = Database(tmp_path / "state.db")
    try:
        wait_until(lambda: sched.ticks >= 1, what="the scheduler did not start")
        ticks = sched.ticks
        # Idle: asleep for up to 30 s, far past the 0.1 s the watchdog allows, yet alive.
        assert pings_during(0, enough=8) >= 8  # 0.35 s at least: past the 0.1 s
        assert sched.ticks == ticks  # it did not tick meanwhile
        # Stuck: a task due now, but another connection holds the write lock its claim needs.
        with blocker.transaction() as c:
            insert_task(c, group_folder="main", chat_jid="tg:1", prompt="p",
                        schedule_type="interval", schedule_value="3600000", timezone="UTC",
                        task_id="t", catch_up=True, task_timezone="UTC")
            update_task_fields(c, "t", next_run=schedule.to_iso(
                schedule.utc_now() - timedelta(seconds=1)))
        blocker.conn.execute("BEGIN IMMEDIATE")
        sched.wake()
        wait_until(lambda: time.monotonic() - sched.alive_at() > 0.2,
                   what="the scheduler stays fresh")
        assert pings_during(0.3) == 0
        blocker.conn.execute("ROLLBACK")
        wait_until(lambda: ran == ["t"], what="the task did not run once the lock was gone")
        assert pings_during(0, enough=3) >= 3
    finally:
        if blocker.conn.in_transaction:
            blocker.conn.execute("ROLLBACK")
        asyncio.run_coroutine_threadsafe(sched.stop(timeout=5), loop).result(10)
        thread.join(10)
        loop.close()
        blocker.close()
        db.close()
