"""Every host operation on a container-writable path, against every trick a container has.

The table below lists the host's operations on the folders a container can write (writers,
readers, mkdir, mode changes, copies, removals, measuring) with the path each one touches.
Each is run with that path replaced, as a hostile agent would, by a symlink to a host file,
a symlink to a host folder, a FIFO, a directory, and a hard link to a host file; and, for
the operations that walk into a folder, with the folder swapped back and forth for a
symlink while the operation repeats. Every case asserts that the host's own file and folder
are unchanged (bytes, mode, listing) and that the operation returned within a bound, whether
it succeeded, refused or failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipc_helpers import Env
from mdclaw import agentfs
from mdclaw.ipc import spool
from mdclaw.ipc.writers import remove_close, write_close, write_follow_up, write_snapshots
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner

BOUND = 10.0  # seconds any one operation may take, whatever stands in its way
SECRET = b"host secret: the container must never read, change or chmod this\n"


@dataclass
class World:
    env: Env
    host_file: Path
    host_dir: Path

    @property
    def data(self) -> Path:
        return self.env.data

    def snapshot(self) -> tuple:
        """What must not change: the host file's bytes and mode, the host folder's listing
        and mode (and each entry's bytes and mode)."""
        f = self.host_file
        entries = sorted((p.name, p.read_bytes(), stat.S_IMODE(p.lstat().st_mode))
                         for p in self.host_dir.iterdir())
        return (f.read_bytes(), stat.S_IMODE(f.stat().st_mode), f.stat().st_nlink > 0,
                stat.S_IMODE(self.host_dir.stat().st_mode), entries)


@pytest.fixture
def world(tmp_path: Path):  # noqa: ANN201
    env = Env(tmp_path)
    host_file = tmp_path / "host" / "secret.txt"
    host_file.parent.mkdir()
    host_file.write_bytes(SECRET)
    host_file.chmod(0o600)
    host_dir = tmp_path / "host" / "folder"
    host_dir.mkdir(mode=0o700)
    (host_dir / "keep.txt").write_bytes(b"keep")
    (host_dir / "keep.txt").chmod(0o600)
    host_dir.chmod(0o700)
    agentfs.ensure_group_dirs(env.engine.layout, "family")
    yield World(env, host_file, host_dir)
    env.close()


# --------------------------------------------------------------------------- operations


def _settings(w: World) -> None:
    ContainerRunner(w.env.cfg, None).write_agent_settings("family")  # type: ignore[arg-type]


def _close(w: World) -> None:
    write_close(w.env.engine.layout, "family")


def _remove_close(w: World) -> None:
    remove_close(w.env.engine.layout, "family")


def _follow_up(w: World) -> None:
    write_follow_up(w.env.engine.layout, "family", sender="u", sender_name="U", content="hi")


def _snapshots(w: World) -> None:
    write_snapshots(w.env.db, w.env.engine.layout, {"family"})


def _action_result(w: World) -> None:
    w.env.write("family", {"type": "memory_search", "requestId": "r1",
                           "params": {"query": "secret"}}, sub="actions")
    w.env.drain_and_run()  # the action worker writes the result


def _group_dirs(w: World) -> None:
    agentfs.ensure_group_dirs(w.env.engine.layout, "family")


def _reconcile(w: World) -> None:
    reconcile(w.env.cfg, w.env.db)


def _read_command(w: World) -> None:
    w.env.drain()


def _memory(w: World) -> None:
    _action_result(w)
    result = (w.data / "ipc" / "family" / "action_results" / "r1.json")
    if result.is_file() and not result.is_symlink():
        assert b"host secret" not in result.read_bytes()


def _send_file(w: World) -> None:
    w.env.write("family", {"type": "send_file", "chatJid": "tg:2",
                           "filePath": "/workspace/group/out/a.txt"}, sub="messages")
    w.env.drain()
    for row in w.env.outbox():
        if row["file_path"]:
            assert b"host secret" not in Path(row["file_path"]).read_bytes()


def _stale_temps(w: World) -> None:
    w.env.engine.start()


def _usage(w: World) -> None:
    with agentfs.opened(w.data / "groups", "family") as fd:
        use = agentfs.tree_usage(fd)
    assert use.bytes < 1024 * 1024  # the host's big file behind a link is not counted


Op = Callable[[World], None]

# (name, operation, path it touches relative to data_dir, what normally stands there)
OPERATIONS: list[tuple[str, Op, str, str]] = [
    ("settings file", _settings, "sessions/family/.claude/settings.json", "file"),
    ("settings folder", _settings, "sessions/family/.claude", "dir"),
    ("close sentinel", _close, "ipc/family/input/_close", "file"),
    ("close folder", _close, "ipc/family/input", "dir"),
    ("stale close removal", _remove_close, "ipc/family/input/_close", "file"),
    ("stale close removal folder", _remove_close, "ipc/family/input", "dir"),
    ("follow-up folder", _follow_up, "ipc/family/input", "dir"),
    ("tasks snapshot", _snapshots, "ipc/family/current_tasks.json", "file"),
    ("groups snapshot", _snapshots, "ipc/family/available_groups.json", "file"),
    ("action result", _action_result, "ipc/family/action_results/r1.json", "file"),
    ("action results folder", _action_result, "ipc/family/action_results", "dir"),
    ("group folders (mkdir, fchmod)", _group_dirs, "ipc/family/tasks", "dir"),
    ("settings folder (mkdir)", _group_dirs, "sessions/family/.claude", "dir"),
    ("reconcile (repair, fix mode)", _reconcile, "ipc/family/messages", "dir"),
    ("command file read + quarantine", _read_command, "ipc/family/tasks/x.json", "file"),
    ("memory file read", _memory, "groups/family/MEMORY.md", "file"),
    ("memory folder read", _memory, "groups/family/memory", "dir"),
    ("send_file copy", _send_file, "groups/family/out/a.txt", "file"),
    ("send_file folder", _send_file, "groups/family/out", "dir"),
    ("stale temp cleanup", _stale_temps, "ipc/family/input/.x.0123456789ab.tmp", "file"),
    ("disk usage walk", _usage, "groups/family/big", "file"),
]

ATTACKS = ("symlink to a host file", "symlink to a host folder", "fifo", "directory",
           "hard link to a host file")


def _clear(p: Path) -> None:
    if p.is_symlink() or p.is_file() or stat.S_ISFIFO(p.lstat().st_mode):
        p.unlink()
    elif p.is_dir():
        for child in p.iterdir():
            _clear(child)
        p.rmdir()


def _plant(w: World, rel: str, attack: str) -> None:
    p = w.data / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() or p.is_symlink():
        _clear(p)
    if attack == "symlink to a host file":
        p.symlink_to(w.host_file)
    elif attack == "symlink to a host folder":
        p.symlink_to(w.host_dir)
    elif attack == "fifo":
        os.mkfifo(p)
    elif attack == "directory":
        p.mkdir()
        (p / "inner.json").write_text("{}")
    elif attack == "hard link to a host file":
        os.link(w.host_file, p)


def _run_bounded(op: Op, w: World) -> tuple[float, BaseException | None]:
    """Run `op` in a thread; return (seconds, what it raised). Fails if it hangs."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            op(w)
        except BaseException as e:  # noqa: BLE001 - refusing is a fine outcome here
            box[0] = e

    t0 = time.monotonic()
    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(BOUND)
    assert not th.is_alive(), f"the operation hung for more than {BOUND} s"
    if isinstance(box[0], AssertionError):  # a check inside the operation itself
        raise box[0]
    return time.monotonic() - t0, box[0]


@pytest.mark.parametrize("attack", ATTACKS)
@pytest.mark.parametrize(("name", "op", "rel", "normal"), OPERATIONS,
                         ids=[o[0] for o in OPERATIONS])
def test_host_files_survive_every_trick(world: World, name: str, op: Op, rel: str,
                                        normal: str, attack: str) -> None:
    if name == "disk usage walk":
        big = world.host_dir / "big.bin"
        big.write_bytes(b"x" * (4 * 1024 * 1024))
        big.chmod(0o600)
    before = world.snapshot()
    _plant(world, rel, attack)
    if name == "command file read + quarantine" and attack == "directory":
        os.rename(world.data / rel, world.data / "ipc/family/tasks/y.json")
    took, raised = _run_bounded(op, world)
    after = world.snapshot()
    assert after == before, (f"{name} with {attack}: the host's files changed "
                             f"(raised {raised!r})")
    assert took < BOUND


# --------------------------------------------------------------------------- races

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    return _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b),
                           _RENAME_EXCHANGE) == 0


RACES: list[tuple[str, Op, str]] = [
    ("settings write", _settings, "sessions/family/.claude"),
    ("close sentinel", _close, "ipc/family/input"),
    ("follow-up", _follow_up, "ipc/family/input"),
    ("snapshots", _snapshots, "ipc/family"),
    ("group folders", _group_dirs, "ipc/family/tasks"),
    ("send_file", _send_file, "groups/family/out"),
]


@pytest.mark.parametrize(("name", "op", "rel"), RACES, ids=[r[0] for r in RACES])
def test_a_folder_swapped_during_the_operation(world: World, name: str, op: Op,
                                               rel: str) -> None:
    """A container thread renames a symlink to the host folder over the real folder and
    back, as fast as it can, while the host repeats the operation."""
    real = world.data / rel
    real.mkdir(parents=True, exist_ok=True)
    if name == "send_file":
        (real / "a.txt").write_bytes(b"agent file")
    link = real.parent / (real.name + ".link")
    link.symlink_to(world.host_dir)
    before = world.snapshot()
    stop = threading.Event()
    swaps = [0]

    def swapper() -> None:
        # renameat2(RENAME_EXCHANGE): the real folder and the link trade places atomically,
        # so at every instant one of the two stands at the name.
        while not stop.is_set():
            if _exchange(real, link):
                swaps[0] += 1

    th = threading.Thread(target=swapper, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 3.0
        rounds = 0
        while time.monotonic() < deadline and rounds < 300:
            took, _raised = _run_bounded(op, world)
            assert took < BOUND
            rounds += 1
    finally:
        stop.set()
        th.join(5)
    assert swaps[0] > 10 and rounds > 0, (swaps, rounds)
    assert world.snapshot() == before, f"{name}: the host folder changed during the race"


# --------------------------------------------------------------------------- copies


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_file_that_grows_after_the_check_is_refused_at_the_copy(world: World) -> None:
    src = world.data / "groups" / "family" / "big.bin"
    with open(src, "wb") as f:
        f.truncate(1024)
    w = world.env
    w.engine.spool = lambda: None  # the copy is made below, after the file has grown
    w.write("family", {"type": "send_file", "chatJid": "tg:2",
                       "filePath": "/workspace/group/big.bin"}, sub="messages")
    w.drain()
    [row] = w.outbox()
    assert row["source_path"] == "/workspace/group/big.bin" and row["status"] == "pending"
    with open(src, "r+b") as f:
        f.truncate(3 * 1024 ** 3)  # sparse: 3 GiB to read, nothing on disk
    read_before = _rchar()
    spool.spool_pending(w.cfg, w.db, w.engine.layout)
    assert _rchar() - read_before < 4 * 1024 * 1024
    [row] = w.outbox()
    assert row["status"] == "failed" and "too large" in row["last_error"]
    spooled = world.data / "spool" / "outbox"
    assert not spooled.exists() or list(spooled.iterdir()) == []


def test_a_copy_reads_no_further_than_the_limit_plus_one(tmp_path: Path) -> None:
    """The file passed its size check, then grows while it is copied: the copy stops after
    limit + 1 bytes and leaves nothing behind."""
    limit = 1024 * 1024
    src = tmp_path / "growing.bin"
    with open(src, "wb") as f:
        f.truncate(limit)
    fd = os.open(src, os.O_RDONLY)
    (tmp_path / "spool").mkdir()
    try:
        with open(src, "r+b") as f:
            f.truncate(3 * 1024 ** 3)
        read_before = _rchar()
        with agentfs.opened(tmp_path / "spool") as dfd, \
                pytest.raises(agentfs.UnsafePath, match="grew beyond"):
            agentfs.copy_into(fd, dfd, "copy", limit)
        # (+ what reading /proc/self/io itself counts; a full read would be 3 GiB)
        assert _rchar() - read_before <= limit + 1 + 64 * 1024
    finally:
        os.close(fd)
    assert list((tmp_path / "spool").iterdir()) == []


def test_a_file_too_large_at_the_check_is_refused_without_reading(world: World) -> None:
    src = world.data / "groups" / "family" / "huge.bin"
    with open(src, "wb") as f:
        f.truncate(spool.SEND_FILE_MAX_BYTES + 1)
    read_before = _rchar()
    world.env.write("family", {"type": "send_file", "chatJid": "tg:2",
                               "filePath": "/workspace/group/huge.bin"}, sub="messages")
    world.env.drain()
    assert _rchar() - read_before < 4 * 1024 * 1024
    assert world.env.outbox() == []
    errors = [json.loads(p.read_text()) for p in world.env.errors.glob("*.error.json")]
    assert any("too large" in e["error"] for e in errors), errors


@pytest.mark.parametrize(("written", "size", "limit", "expected"), [
    (b"12345", 5, 100, b"12345"),            # the size fstat gave: one read
    (b"", 0, 100, b""),                      # empty, and still empty
    (b"1234567890", 5, 100, b"1234567890"),  # grew after the fstat: read to its end
    (b"1234", 10, 100, b"1234"),             # shrank after the fstat: what is there
    (b"x" * 150, 5, 100, None),              # grew past the limit: refused
    (b"x" * 150, 150, 100, None),            # larger than the limit from the start
])
def test_a_bounded_read_with_the_size_fstat_gave(tmp_path: Path, written: bytes, size: int,
                                                 limit: int, expected: bytes | None) -> None:
    """read_fd_bounded asks for the size it is told plus one byte: a file of that size is
    read in one call, and one whose size moved is still read to its end (or refused past
    the limit), never cut at the size it had."""
    p = tmp_path / "f"
    p.write_bytes(written)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert agentfs.read_fd_bounded(fd, limit, size) == expected
    finally:
        os.close(fd)
