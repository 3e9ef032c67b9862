"""The disk rule (mdclaw.diskguard) with real files: what counts, what is decided, who is told.

No real engine: the container side is played by files written into the group's folders; the
orchestrator runs without a runner (the refusal comes before it is needed), and the guard
stops containers run by the real container runner on the tests' fake engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from pathlib import Path

import pytest

from fake_engine import FakeEngine
from mdclaw import agentfs, diskguard
from mdclaw.channels.base import InboundMessage
from mdclaw.config import Config, LiveConfig, floor_bytes, load_config, parse_size
from mdclaw.diskguard import (
    GROUP_FULL,
    HOST_FULL,
    OK,
    TOO_MANY_FILES,
    UNREADABLE,
    DiskGuard,
    check,
    decide,
)
from mdclaw.orchestrator import Orchestrator
from mdclaw.paths import Layout
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerInput, ContainerResult, ContainerRunner
from mdclaw.state import Database
from mdclaw.state.outbox import list_outbox
from waiting import wait_until_async

MiB = 1 << 20
GiB = 1 << 30


def make_cfg(tmp_path: Path, **limits) -> Config:  # noqa: ANN003
    return Config(
        data_dir=tmp_path / "data",
        groups={"main": {"name": "A", "jid": "hl:main", "main": True},
                "family": {"name": "F", "jid": "hl:family", "requires_trigger": False,
                           "disk": "1MiB"}},
        limits={"min_free_disk": "1M", "run_attempts": 1, **limits},
    )


def group_dir(cfg: Config, folder: str = "family") -> Path:
    d = Layout(cfg.data_dir).group_dir(folder)
    d.mkdir(parents=True, exist_ok=True)
    return d


def write(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(n))
        f.flush()
        os.fsync(f.fileno())
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- what counts


def test_real_bytes_over_the_limit_and_back(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    d = group_dir(cfg)
    write(d / "small", 100_000)
    v = check(cfg, "family")
    assert v.state == OK and v.limit == MiB and 100_000 <= v.used < 200_000, v
    big = write(d / "sub" / "big", 2 * MiB)
    v = check(cfg, "family")
    assert v.state == GROUP_FULL and v.used > MiB, v
    assert "over its disk limit" in v.summary()
    assert "my folder is full" in v.chat_text() and "groups.family.disk" in v.chat_text()
    assert "delete files in my folder (groups/family in" in v.chat_text()
    big.unlink()
    assert check(cfg, "family").state == OK


def test_ipc_and_sessions_count_too(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    layout = Layout(cfg.data_dir)
    write(layout.group_ipc_dir("family") / "messages" / "junk", 700_000)
    assert check(cfg, "family").state == OK
    write(layout.sessions_dir / "family" / ".claude" / "log.jsonl", 700_000)
    v = check(cfg, "family")
    assert v.state == GROUP_FULL and v.used >= 1_400_000, v
    # The message names the trees that hold the bytes, not the group folder they are not in.
    assert "(ipc/family and sessions/family in" in v.chat_text() \
        or "(sessions/family and ipc/family in" in v.chat_text(), v.chat_text()
    assert "groups/family" not in v.chat_text()


def test_the_disk_message_names_the_tree_that_holds_the_bytes(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    layout = Layout(cfg.data_dir)
    write(group_dir(cfg) / "notes.md", 20_000)
    write(layout.group_ipc_dir("family") / "messages" / "junk", 2 * MiB)
    v = check(cfg, "family")
    assert v.state == GROUP_FULL, v
    assert v.where() == "ipc/family"
    assert "delete files in my folder (ipc/family in mdclaw's data directory)" in v.chat_text()
    trees = {t[0]: t[1] for t in v.trees}
    assert trees["ipc/family"] >= 2 * MiB and 0 < trees["groups/family"] < 100_000, trees


def test_a_sparse_file_counts_what_it_holds(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    sparse = group_dir(cfg) / "sparse"
    with open(sparse, "wb") as f:
        f.truncate(10 * GiB)  # 10 GiB long, nothing written
        f.write(b"x" * 4096)
    assert sparse.stat().st_size == 10 * GiB
    v = check(cfg, "family")
    assert v.state == OK and v.used < 64 * 1024, v


def test_symlinks_to_big_host_files_are_not_counted(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    outside = write(tmp_path / "host-big", 3 * MiB)
    (tmp_path / "host-dir").mkdir()
    write(tmp_path / "host-dir" / "big", 3 * MiB)
    d = group_dir(cfg)
    (d / "link-to-file").symlink_to(outside)
    (d / "link-to-dir").symlink_to(tmp_path / "host-dir")
    (d / "link-to-root").symlink_to("/")
    v = check(cfg, "family")
    assert v.state == OK and v.used < 64 * 1024, v


def test_hard_links_count_once(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    d = group_dir(cfg)
    f = write(d / "a", 600_000)
    for i in range(3):
        os.link(f, d / f"link{i}")
    v = check(cfg, "family")
    assert v.state == OK and v.used < 700_000, v


def test_too_many_files_counts_as_over(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, disk_files=1000)
    d = group_dir(cfg)
    for i in range(999):
        (d / f"f{i}").touch()
    assert check(cfg, "family").state == OK
    for i in range(999, 1010):
        (d / f"f{i}").touch()
    v = check(cfg, "family")
    assert v.state == TOO_MANY_FILES and "more than 1000 files" in v.chat_text(), v


def test_a_wide_folder_cannot_exhaust_file_descriptors(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    d = group_dir(cfg)
    for i in range(600):
        write(d / f"d{i}" / "f", 1000)
    deep = d
    for i in range(60):
        deep = deep / f"n{i}"
    write(deep / "f", 1000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Room for what is open now and a little more, far fewer than the 600 subfolders.
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + agentfs.USAGE_MAX_FDS + 20, hard))
    try:
        with agentfs.opened(d) as fd:
            u = agentfs.tree_usage(fd)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert u.complete and u.unreadable == 0, u
    assert u.entries == 600 * 2 + 60 + 1, u  # every folder and file seen


def test_decisions_without_files(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, min_free_disk="5%")
    space = agentfs.FreeSpace(total=100 * GiB, free=4 * GiB, files_free=1000)
    v = decide(cfg, "family", agentfs.Usage(bytes=10), "", space)
    assert v.state == HOST_FULL and v.floor == 5 * GiB, v
    assert "disk is nearly full" in v.chat_text()
    space = agentfs.FreeSpace(total=100 * GiB, free=6 * GiB, files_free=1000)
    assert decide(cfg, "family", agentfs.Usage(bytes=10), "", space).state == OK
    v = decide(cfg, "family", agentfs.Usage(bytes=10, unreadable=1), "groups/family/x", space)
    assert v.state == UNREADABLE and "groups/family/x" in v.chat_text(), v
    v = decide(cfg, "family", agentfs.Usage(bytes=10, unreadable=1), "sessions/family/y", space)
    assert "(sessions/family in mdclaw's data directory)" in v.chat_text(), v.chat_text()
    # no limit for main: only the host's floor applies (limits.disk null)
    nolimit = make_cfg(tmp_path, disk=None)
    assert nolimit.disk_limit("main") is None
    assert decide(nolimit, "main", agentfs.Usage(bytes=100 * GiB), "", space).state == OK
    assert floor_bytes("1GiB", 10) == GiB and floor_bytes("5%", 200) == 10


def test_config_sizes_and_errors(write_config) -> None:
    assert [parse_size(v) for v in ("500M", "2G", "1GiB", "1.5GB", "64k", 7)] == [
        500 * MiB, 2 * GiB, GiB, 1_500_000_000, 65536, 7]
    from mdclaw.config import ConfigError
    with pytest.raises(ConfigError) as e:
        load_config(write_config("""\
            data_dir: {data_dir}
            groups:
              main: {name: A, jid: "hl:main", main: true, disk: lots}
            limits: {min_free_disk: 150%}
        """))
    text = str(e.value)
    assert "groups.main.disk" in text and "invalid size 'lots'" in text
    assert "limits.min_free_disk" in text and "between 0 and 100" in text
    cfg = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true, disk: 2G, proxy_connections: 4}
          other: {name: B, jid: "hl:b"}
        limits: {disk: 500M, proxy_requests_per_minute: 60}
    """))
    assert cfg.disk_limit("main") == 2 * GiB and cfg.disk_limit("other") == 500 * MiB
    assert cfg.proxy_caps("main") == (4, 60) and cfg.proxy_caps("other") == (32, 60)
    assert Config().limits.disk == "10GiB" and Config().limits.min_free_disk == "1GiB"


# --------------------------------------------------------------------------- who is told


def msg(i: int, jid: str, text: str = "hello") -> InboundMessage:
    return InboundMessage(id=f"{jid}:{i}", chat_jid=jid, sender="u1", sender_name="Alice",
                          content=text, timestamp=f"2026-01-01T00:00:{i:02d}.000Z",
                          channel="http")


def test_refused_runs_tell_the_chat_once_and_runs_resume(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    big = write(group_dir(cfg) / "big", 2 * MiB)

    async def main() -> None:
        guard = DiskGuard(cfg)
        orch = Orchestrator(cfg, db, runner=None, diskguard=guard)
        for i in (1, 2, 3):  # three messages while over: one message to the chat
            await orch.on_inbound(msg(i, "hl:family"))
            await asyncio.wait_for(orch.queue.join(), 10)
        assert guard.blocked("family") is not None
        assert orch.queue.failures == []  # refused, not failed and retried
        # main is not affected by family's limit
        await orch.on_inbound(msg(1, "hl:main"))
        await asyncio.wait_for(orch.queue.join(), 10)
        big.unlink()
        await orch.on_inbound(msg(4, "hl:family"))
        await asyncio.wait_for(orch.queue.join(), 10)
        assert guard.blocked("family") is None

    asyncio.run(main())
    rows = sorted(list_outbox(db), key=lambda r: r.id)
    texts = [(r.chat_jid, r.text) for r in rows]
    family = [t for j, t in texts if j == "hl:family"]
    assert len(family) == 2, texts
    assert "my folder is full" in family[0] and "of 1 MiB" in family[0]
    # allowed again: the run went on to the (missing) engine, which is a different story,
    # told as such; while refused, the messages waited instead of being set aside
    assert "container engine on the server is not reachable" in family[1]
    assert "container engine" in [t for j, t in texts if j == "hl:main"][0]
    failed = db.query("SELECT cause, messages FROM failed_turns WHERE group_folder = ?",
                      ("family",))
    assert [(r["cause"], r["messages"]) for r in failed] == [("engine_down", 4)]
    db.close()


def test_guard_notices_once_per_episode(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    d = group_dir(cfg)
    big = write(d / "big", 2 * MiB)
    guard = DiskGuard(cfg)

    async def main() -> list:
        out = []
        v = await guard.admit("family")
        out += [guard.notice("family", v), guard.notice("family", v)]
        big.unlink()
        out.append((await guard.admit("family")).state)
        write(d / "big", 2 * MiB)
        v = await guard.admit("family")
        out.append(guard.notice("family", v))
        return out

    first, second, state, again = asyncio.run(main())
    assert first and "my folder is full" in first
    assert second is None and state == OK and again == first


class Containers:
    """Groups' containers started by the real runner on the fake engine; each works until it
    is killed (what the guard does to a group over its limit)."""

    def __init__(self, cfg: Config) -> None:
        self.engine = FakeEngine(default=lambda c: c.hang(60))
        self.runner = ContainerRunner(cfg, self.engine)
        self.runs: list[asyncio.Future[ContainerResult]] = []

    async def start(self, *folders: str) -> None:
        for f in folders:
            self.runs.append(asyncio.ensure_future(self.runner.run(
                f, ContainerInput("work", f, f"hl:{f}"))))
        await wait_until_async(lambda: all((h := self.runner.active(f)) and h.container_id
                                           for f in folders), what=f"{folders} to start")

    def killed(self, folder: str) -> bool:
        c = self.engine.container_of(folder)
        return c is not None and c.killed

    async def wait_killed(self, folder: str, timeout: float = 10) -> None:
        await wait_until_async(lambda: self.killed(folder), timeout,
                               what=f"{folder}'s container to be stopped")

    async def end(self) -> list[ContainerResult]:
        """Kill what still runs; the runs' results."""
        for folder in self.runner.running():
            handle = self.runner.active(folder)
            if handle is not None:
                await handle.kill()
        results = await asyncio.wait_for(asyncio.gather(*self.runs), 10)
        await self.runner.aclose()
        return results


def test_periodic_round_stops_only_the_group_over_its_limit(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, disk_check_interval="100ms")
    group_dir(cfg, "main")
    d = group_dir(cfg)
    running = Containers(cfg)
    guard = DiskGuard(cfg, running.runner)

    async def main() -> tuple[float, bool, list[ContainerResult]]:
        await running.start("family", "main")
        stop = asyncio.Event()
        task = asyncio.create_task(guard.run(stop))
        await asyncio.sleep(0)  # let the first round see the group within its limit
        write(d / "big", 2 * MiB)
        t0 = asyncio.get_running_loop().time()
        await running.wait_killed("family")
        took = asyncio.get_running_loop().time() - t0
        stop.set()
        await task
        main_killed = running.killed("main")
        return took, main_killed, await running.end()

    took, main_killed, (family, _) = asyncio.run(main())
    assert took < 5
    assert not main_killed
    assert family.exit_code == 137 and family.status == "error"
    assert guard.status()["blocked"]["family"]["state"] == GROUP_FULL
    json.dumps(guard.status())  # the daemon's status file takes it as it is


def test_below_the_free_space_floor_every_container_stops(tmp_path: Path) -> None:
    total = agentfs.free_space(tmp_path).total
    cfg = make_cfg(tmp_path, min_free_disk="99.99%")  # this disk is never that empty
    group_dir(cfg, "main")
    group_dir(cfg)
    running = Containers(cfg)
    guard = DiskGuard(cfg, running.runner)

    async def main() -> list:
        await running.start("family", "main")
        verdicts = await guard.check_once()
        await running.wait_killed("family")
        await running.wait_killed("main")
        await running.end()
        return verdicts

    verdicts = asyncio.run(main())
    assert {v.state for v in verdicts} == {HOST_FULL}, verdicts
    assert guard.status()["floor"] == floor_bytes("99.99%", total)


def test_status_and_doctor_name_the_group_and_the_size(cli, write_config, data_dir) -> None:
    cfg = str(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true}
          family: {name: F, jid: "hl:family", disk: 1MiB}
        limits: {min_free_disk: 1M}
    """))
    assert cli("reconcile", "--config", cfg).returncode == 0
    write(data_dir / "groups" / "family" / "big", 2 * MiB)
    r = cli("status", "--config", cfg)
    assert r.returncode == 0, r.stderr
    # the health section names the group; the disk section says how far over it is
    assert any(x.strip() == "FAIL  1 group is over its disk limit (family) (operator page: "
               "#groups)" for x in r.stdout.splitlines()), r.stdout
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("family:"))
    assert "2.0 MiB of 1 MiB" in line and "runs are refused" in line, r.stdout
    s = json.loads(cli("status", "--json", "--config", cfg).stdout)
    assert s["disk"]["groups"]["family"]["state"] == GROUP_FULL
    assert s["disk"]["groups"]["main"]["state"] == OK
    r = cli("doctor", "--json", "--config", cfg)
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["disk family"]["level"] == "fail"
    assert "2.0 MiB of 1 MiB" in checks["disk family"]["detail"]
    assert "groups.family.disk" in checks["disk family"]["fix"]
    assert checks["disk"]["level"] == "ok" and checks["disk main"]["level"] == "ok"


def test_the_module_uses_only_the_one_door() -> None:
    import inspect
    import re

    src = inspect.getsource(diskguard)
    assert not re.search(r"\bos\.(stat|lstat|listdir|walk|scandir|statvfs)|shutil\.|\.stat\(",
                         src)


def test_free_space_is_checked_every_second_between_rounds(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, disk_check_interval="1h")
    group_dir(cfg, "main")
    group_dir(cfg)
    running = Containers(cfg)
    guard = DiskGuard(cfg, running.runner)

    async def main() -> float:
        await running.start("family", "main")
        stop = asyncio.Event()
        task = asyncio.create_task(guard.run(stop))
        # The first (full) round is done; the next is an hour away.
        await wait_until_async(lambda: guard.rounds >= 1)
        # The disk "fills up": a floor this disk never meets (no wake: only the tick sees it).
        # A holder of its own, which wakes nobody: only the tick may see the new floor.
        guard.live = LiveConfig(make_cfg(tmp_path, disk_check_interval="1h",
                                         min_free_disk="99.99%"), fixed=True)
        t0 = asyncio.get_running_loop().time()
        await running.wait_killed("family")
        await running.wait_killed("main")
        took = asyncio.get_running_loop().time() - t0
        stop.set()
        await task
        await running.end()
        return took

    took = asyncio.run(main())
    assert took < diskguard.HOST_TICK + 1.5, took
    assert guard.rounds == 1
    assert {v["state"] for v in guard.status()["blocked"].values()} == {HOST_FULL}


def _usage_as(uid: int, root: Path) -> agentfs.Usage:
    """tree_usage of `root` measured by a forked child running as `uid` (the fd is opened
    here, as the daemon opens its trusted roots)."""
    fd = agentfs.open_root(root)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, measure, report, exit without cleanup
        try:
            os.close(r)
            if uid != os.geteuid():
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            u = agentfs.tree_usage(fd)
            os.write(w, json.dumps(u.__dict__).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.close(fd)
    with os.fdopen(r) as f:
        data = f.read()
    os.waitpid(pid, 0)
    return agentfs.Usage(**json.loads(data))


def test_a_folder_the_daemon_cannot_read_counts_as_over(tmp_path: Path) -> None:
    # A container may chmod 000 a folder of its own; a daemon not running as root cannot
    # look inside it, so the group's size cannot be known.
    cfg = make_cfg(tmp_path)
    d = group_dir(cfg)
    write(d / "seen" / "a", 1000)
    write(d / "hidden" / "x", 3 * MiB)
    os.chmod(d, 0o755)
    os.chmod(d / "hidden", 0)
    uid = 65534 if os.geteuid() == 0 else os.geteuid()
    try:
        u = _usage_as(uid, d)
    finally:
        os.chmod(d / "hidden", 0o755)
    assert u.unreadable == 1 and u.first_unreadable == "hidden", u
    assert u.bytes < MiB  # what is inside was not seen
    v = decide(cfg, "family", u, "groups/family/hidden", None)
    assert v.state == UNREADABLE and "groups/family/hidden" in v.chat_text(), v


def test_free_space_ticks_only_once_a_run_is_admitted(tmp_path: Path) -> None:
    """With no container there is nothing to stop: the guard sleeps until its next round.
    A run admitted starts the one-second free-space tick before its container shows."""
    cfg = make_cfg(tmp_path, disk_check_interval="1h")
    group_dir(cfg, "main")
    group_dir(cfg)
    running = Containers(cfg)  # no container yet
    guard = DiskGuard(cfg, running.runner)

    async def main() -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(guard.run(stop))
        await wait_until_async(lambda: guard.rounds >= 1)
        await asyncio.sleep(diskguard.HOST_TICK + 0.3)  # a window in which nothing may tick
        assert guard.host_checks == 0
        assert (await guard.admit("family")).ok
        await running.start("family")  # its container starts
        # A holder of its own, which wakes nobody: only the tick may see the new floor.
        guard.live = LiveConfig(make_cfg(tmp_path, disk_check_interval="1h",
                                         min_free_disk="99.99%"), fixed=True)
        t0 = asyncio.get_running_loop().time()
        await running.wait_killed("family")
        took = asyncio.get_running_loop().time() - t0
        stop.set()
        await task
        await running.end()
        return took

    took = asyncio.run(main())
    assert took < diskguard.HOST_TICK + 1.5, took
    assert guard.rounds == 1 and guard.host_checks >= 1
