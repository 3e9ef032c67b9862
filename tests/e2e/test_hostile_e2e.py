"""A hostile container must not reach host files through the folders it shares with the host.

Everything an agent container writes is untrusted, including symlinks in its mounted folders:
the link text is only a string inside the container, but the daemon resolves it on the host.
Each test here lets a process inside the live container (an exec in the running container, the
same uid and groups as the agent) plant a symlink to a host path outside data_dir, then drives
the daemon's side through public behaviour only: `ContainerRunner.run(...)`,
`runner.active(folder)` / `RunHandle.close()` and the configured idle timeout. The assertions
are on host-side effects only: the host file keeps its bytes and mode, the host folder gets no
new entry, and the host operation returns within a bound. Whether the hostile run itself
succeeds, fails or is refused is recorded, not asserted.

The agent is tests/e2e/fake_agent.py in `idle` mode: it prints one block, then waits for
`input/_close`. The link is planted when that first block arrives (so the container is running
and its folders are mounted), before the daemon acts.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shlex
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from mdclaw.config import Config
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import install_labels
from waiting import wait_until_async

pytestmark = pytest.mark.e2e

FOLDER = "family"  # a non-main group
IDLE = 1.5  # seconds, for the idle-timeout tests
PLANT_DEADLINE = 60.0  # container start plus the exec that plants the link
HOST_OP_BOUND = 5.0  # a close() or a settings write is a few file operations
RUN_BOUND = 60.0  # a whole run of the fake agent, start to result
SECRET = b"host-only data: the container must never change this\n"


def make_config(tmp_path: Path, install_id: str, image: str, **limits: Any) -> Config:
    return Config(
        data_dir=tmp_path / "data",
        groups={"main": {"name": "Admin", "jid": "tg:1", "main": True},
                FOLDER: {"name": "Family", "jid": "tg:2"}},
        limits={"container_timeout": "30s", "idle_timeout": "20s", "memory": "256m",
                "cpus": 1.0, "pids": 64, **limits},
        runtime={"image": image, "install_id": install_id},
    )


def inp(folder: str = FOLDER) -> ContainerInput:
    return ContainerInput(prompt="hello", group_folder=folder, chat_jid="tg:2")


@pytest.fixture
def setup(tmp_path, engine, agent_image, install_id, reap):
    """setup(**limits) -> (cfg, runner)."""

    def make(**limits: Any) -> tuple[Config, ContainerRunner]:
        cfg = make_config(tmp_path, install_id, agent_image, **limits)
        reap(install_labels(cfg))
        return cfg, ContainerRunner(cfg, engine)

    return make


@pytest.fixture
def docker_client(engine):
    client = docker.DockerClient(base_url=engine.base_url, timeout=60)
    yield client
    client.close()


# --------------------------------------------------------------------------- host side


@dataclass(frozen=True)
class Entry:
    kind: str  # "file", "dir", "link", "other"
    mode: int
    data: bytes | str | None  # a file's bytes, a link's text


def entry(path: Path) -> Entry | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return Entry("link", mode, os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        return Entry("file", mode, path.read_bytes())
    if stat.S_ISDIR(st.st_mode):
        return Entry("dir", mode, None)
    return Entry("other", mode, None)


def tree(folder: Path) -> dict[str, Entry | None]:
    """The folder itself ("."), and every entry under it, without following links."""
    out: dict[str, Entry | None] = {".": entry(folder)}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(folder))] = entry(p)
    return out


def host_file(tmp_path: Path, name: str = "victim.txt") -> Path:
    """A host file outside data_dir, known bytes, mode 0600."""
    d = tmp_path / "host"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_bytes(SECRET)
    os.chmod(p, 0o600)
    return p


def host_folder(tmp_path: Path, *, with_close: bool = False) -> Path:
    """A host folder outside data_dir with a file in it (and a `_close` when asked)."""
    d = tmp_path / "host" / "folder"
    d.mkdir(parents=True)
    os.chmod(d, 0o700)
    (d / "keep.txt").write_bytes(SECRET)
    os.chmod(d / "keep.txt", 0o600)
    if with_close:
        (d / "_close").write_bytes(b"a host file that happens to be called _close\n")
        os.chmod(d / "_close", 0o600)
    return d


def assert_file_unchanged(path: Path, before: Entry, what: str, outcome: dict[str, Any]) -> None:
    after = entry(path)
    same = after == before
    assert same, (
        f"{what}: the host file {path} was changed through the container's symlink: "
        f"{describe(before)} -> {describe(after)}; host calls: {outcome}")


def assert_tree_unchanged(folder: Path, before: dict[str, Entry | None], what: str,
                          outcome: dict[str, Any]) -> None:
    after = tree(folder)
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    same = after == before
    assert same, (
        f"{what}: the host folder {folder} was changed through the container's symlink: "
        f"new {[(k, describe(after[k])) for k in added]}, "
        f"gone {[(k, describe(before[k])) for k in removed]}, "
        f"changed {[(k, describe(before[k]), describe(after[k])) for k in changed]}; "
        f"host calls: {outcome}")


def describe(e: Entry | None) -> str:
    if e is None:
        return "absent"
    return f"{e.kind} mode {oct(e.mode)} {e.data!r}"


# --------------------------------------------------------------------------- container side


def in_container(client: docker.DockerClient, container_id: str, script: str) -> str:
    """Run `script` with sh inside the running container, as its user; return its output."""
    res = client.containers.get(container_id).exec_run(["sh", "-c", script])
    out = res.output.decode("utf-8", "replace")
    assert res.exit_code == 0, f"exec in the container failed ({res.exit_code}): {out}"
    return out


class HostileRun:
    """One `idle` run of the group; `script` runs inside the container at its first block."""

    def __init__(self, runner: ContainerRunner, client: docker.DockerClient, script: str,
                 folder: str = FOLDER) -> None:
        self.runner = runner
        self.client = client
        self.script = script
        self.folder = folder
        self.planted = asyncio.Event()
        self.plant_error: BaseException | None = None
        self.task: asyncio.Task[Any] | None = None

    async def _on_output(self, _text: str) -> None:
        if self.planted.is_set():
            return
        try:
            handle = self.runner.active(self.folder)
            assert handle is not None and handle.container_id, "no running container"
            await asyncio.to_thread(in_container, self.client, handle.container_id,
                                    self.script)
        except BaseException as e:  # noqa: BLE001 - re-raised in start()
            self.plant_error = e
        finally:
            self.planted.set()

    async def start(self) -> None:
        """Start the run and return once the container has planted its link."""
        self.task = asyncio.create_task(self.runner.run(
            self.folder, inp(self.folder), command=["idle"], on_output=self._on_output))
        waiter = asyncio.create_task(self.planted.wait())
        done, _ = await asyncio.wait({self.task, waiter}, timeout=PLANT_DEADLINE,
                                     return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if self.plant_error is not None:
            raise self.plant_error
        if waiter not in done:
            detail = ("still starting" if not self.task.done() else
                      summary(self.task.exception() or self.task.result()))
            pytest.fail(f"the container did not get to plant its link: {detail}")

    async def wait_closed_or_done(self, bound: float) -> float:
        """Wait (polling) until the run's handle is closed or the run has ended."""
        t0 = time.monotonic()
        task = self.task
        assert task is not None

        def closed_or_done() -> bool:
            handle = self.runner.active(self.folder)
            return task.done() or handle is None or handle.closed

        await wait_until_async(closed_or_done, bound, interval=0.05,
                               what="the idle timer to close the run")
        return time.monotonic() - t0

    async def finish(self, grace: float = 0.0) -> Any:
        """End the run: give it `grace` seconds to end on its own, then kill it if it is
        still there; return its result or exception."""
        assert self.task is not None
        if grace:
            await asyncio.wait({self.task}, timeout=grace)
        handle = self.runner.active(self.folder)
        if handle is not None and not self.task.done():
            try:
                await handle.kill()
            except Exception:  # noqa: BLE001 - it may have ended on its own meanwhile
                pass
        try:
            return await asyncio.wait_for(asyncio.shield(self.task), RUN_BOUND)
        except TimeoutError:
            pytest.fail(f"the run did not end within {RUN_BOUND} s after it was killed")
        except Exception as e:  # noqa: BLE001 - recorded, not asserted
            return e
        finally:
            await self.runner.aclose()


async def close_now(runner: ContainerRunner, folder: str = FOLDER) -> tuple[float, Any]:
    """`RunHandle.close()` on the group's run; (seconds it took, what it returned/raised)."""
    handle = runner.active(folder)
    assert handle is not None, "the run is not active any more"
    t0 = time.monotonic()
    try:
        r = handle.close()
        if inspect.isawaitable(r):
            r = await asyncio.wait_for(r, HOST_OP_BOUND * 2)
        got: Any = r
    except Exception as e:  # noqa: BLE001 - a refusal is fine; only host effects count
        got = e
    return time.monotonic() - t0, got


async def plain_run(runner: ContainerRunner, folder: str = FOLDER) -> tuple[float, Any]:
    """One short, well-behaved run of the group; (seconds, result or exception)."""
    t0 = time.monotonic()
    try:
        got: Any = await asyncio.wait_for(
            runner.run(folder, inp(folder), command=["blocks", "1", "0"]), RUN_BOUND)
    except TimeoutError:
        pytest.fail(f"the run did not return within {RUN_BOUND} s")
    except Exception as e:  # noqa: BLE001 - a refused run is fine; only host effects count
        got = e
    finally:
        await runner.aclose()
    return time.monotonic() - t0, got


def run(coro):
    return asyncio.run(coro)


def summary(value: Any) -> str:
    """A short description of a run's result or a host call's exception, for messages."""
    if isinstance(value, BaseException):
        return f"raised {value!r}"
    status = getattr(value, "status", None)
    if status is not None:
        return f"{status} (exit {value.exit_code}, closed_idle={value.closed_idle})"
    return repr(value)


# --------------------------------------------------------------------------- 1: settings


def test_a_planted_settings_temp_link_does_not_overwrite_a_host_file(setup, docker_client,
                                                                    tmp_path):
    """Run 1 links `.settings.json.<daemon pid>.tmp` to a host file; run 2 writes settings."""
    cfg, runner = setup()
    victim = host_file(tmp_path)
    before = entry(victim)
    pid = os.getpid()  # the runner runs in this process: the daemon's pid
    link = f"/home/node/.claude/.settings.json.{pid}.tmp"
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             f"ln -s {shlex.quote(str(victim))} {shlex.quote(link)}")
        await hostile.start()
        planted = cfg.data_dir / "sessions" / FOLDER / ".claude" / f".settings.json.{pid}.tmp"
        assert os.readlink(planted) == str(victim)  # the container really planted it
        outcome["close 1"] = summary((await close_now(runner))[1])
        outcome["run 1"] = summary(await hostile.finish(grace=10))
        took, res = await plain_run(runner)
        outcome["run 2"] = summary(res)
        outcome["run 2 seconds"] = round(took, 2)

    run(go())
    assert_file_unchanged(victim, before, "settings written for run 2", outcome)
    assert outcome["run 2 seconds"] < RUN_BOUND


def test_a_settings_file_swapped_for_a_link_does_not_overwrite_a_host_file(setup,
                                                                          docker_client,
                                                                          tmp_path):
    """Run 1 replaces `settings.json` with a link to a host file; run 2 writes settings."""
    cfg, runner = setup()
    victim = host_file(tmp_path)
    before = entry(victim)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             "rm -f /home/node/.claude/settings.json && "
                             f"ln -s {shlex.quote(str(victim))} /home/node/.claude/settings.json")
        await hostile.start()
        planted = cfg.data_dir / "sessions" / FOLDER / ".claude" / "settings.json"
        assert os.readlink(planted) == str(victim)
        outcome["close 1"] = summary((await close_now(runner))[1])
        outcome["run 1"] = summary(await hostile.finish(grace=10))
        took, res = await plain_run(runner)
        outcome["run 2"] = summary(res)
        outcome["run 2 seconds"] = round(took, 2)

    run(go())
    assert_file_unchanged(victim, before, "settings written for run 2", outcome)
    assert outcome["run 2 seconds"] < RUN_BOUND


# --------------------------------------------------------------------------- 2: _close link

CLOSE_IN_CONTAINER = "/workspace/ipc/input/_close"


def test_close_does_not_truncate_a_host_file_through_a_close_link(setup, docker_client,
                                                                  tmp_path):
    """The container links `input/_close` to a host file; the host closes the conversation."""
    cfg, runner = setup()
    victim = host_file(tmp_path)
    before = entry(victim)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             f"ln -s {shlex.quote(str(victim))} {CLOSE_IN_CONTAINER}")
        await hostile.start()
        planted = cfg.data_dir / "ipc" / FOLDER / "input" / "_close"
        assert os.readlink(planted) == str(victim)
        took, got = await close_now(runner)
        outcome["close"] = summary(got)
        outcome["close seconds"] = round(took, 3)
        outcome["right after close"] = describe(entry(victim))
        outcome["run"] = summary(await hostile.finish())

    run(go())
    assert_file_unchanged(victim, before, "RunHandle.close()", outcome)
    assert outcome["close seconds"] < HOST_OP_BOUND, outcome


def test_the_idle_timeout_does_not_truncate_a_host_file_through_a_close_link(setup,
                                                                             docker_client,
                                                                             tmp_path):
    """The container links `input/_close` to a host file, then goes quiet until idle."""
    cfg, runner = setup(idle_timeout=f"{int(IDLE * 1000)}ms")
    victim = host_file(tmp_path)
    before = entry(victim)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             f"ln -s {shlex.quote(str(victim))} {CLOSE_IN_CONTAINER}")
        await hostile.start()
        planted = cfg.data_dir / "ipc" / FOLDER / "input" / "_close"
        assert os.readlink(planted) == str(victim)
        outcome["closed after seconds"] = round(
            await hostile.wait_closed_or_done(IDLE + HOST_OP_BOUND + 10), 2)
        outcome["right after idle close"] = describe(entry(victim))
        outcome["run"] = summary(await hostile.finish())

    run(go())
    assert_file_unchanged(victim, before, "idle timeout", outcome)


# --------------------------------------------------------------------------- 3: input/ link

SWAP_INPUT = ("mv /workspace/ipc/input /workspace/ipc/input.moved && "
              "ln -s {target} /workspace/ipc/input")


def test_close_does_not_write_into_a_host_folder_through_a_swapped_input(setup, docker_client,
                                                                         tmp_path):
    """The container replaces `input/` with a link to a host folder; the host closes."""
    cfg, runner = setup()
    folder = host_folder(tmp_path)
    before = tree(folder)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             SWAP_INPUT.format(target=shlex.quote(str(folder))))
        await hostile.start()
        assert os.readlink(cfg.data_dir / "ipc" / FOLDER / "input") == str(folder)
        took, got = await close_now(runner)
        outcome["close"] = summary(got)
        outcome["close seconds"] = round(took, 3)
        outcome["run"] = summary(await hostile.finish())

    run(go())
    assert_tree_unchanged(folder, before, "RunHandle.close()", outcome)
    assert outcome["close seconds"] < HOST_OP_BOUND, outcome


def test_the_idle_timeout_does_not_write_into_a_host_folder_through_a_swapped_input(
        setup, docker_client, tmp_path):
    """The container replaces `input/` with a link to a host folder, then goes quiet."""
    cfg, runner = setup(idle_timeout=f"{int(IDLE * 1000)}ms")
    folder = host_folder(tmp_path)
    before = tree(folder)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             SWAP_INPUT.format(target=shlex.quote(str(folder))))
        await hostile.start()
        assert os.readlink(cfg.data_dir / "ipc" / FOLDER / "input") == str(folder)
        outcome["closed after seconds"] = round(
            await hostile.wait_closed_or_done(IDLE + HOST_OP_BOUND + 10), 2)
        outcome["run"] = summary(await hostile.finish())

    run(go())
    assert_tree_unchanged(folder, before, "idle timeout", outcome)


def test_the_next_run_does_not_touch_a_host_folder_through_a_swapped_input(setup,
                                                                           docker_client,
                                                                           tmp_path):
    """Run 1 swaps `input/` for a link to a host folder holding a `_close`, and is killed
    (nothing closes it); run 2 of the group starts, and ends on its own."""
    cfg, runner = setup()
    folder = host_folder(tmp_path, with_close=True)
    before = tree(folder)
    outcome: dict[str, Any] = {}

    async def go() -> None:
        hostile = HostileRun(runner, docker_client,
                             SWAP_INPUT.format(target=shlex.quote(str(folder))))
        await hostile.start()
        assert os.readlink(cfg.data_dir / "ipc" / FOLDER / "input") == str(folder)
        outcome["run 1"] = summary(await hostile.finish())
        took, res = await plain_run(runner)
        outcome["run 2"] = summary(res)
        outcome["run 2 seconds"] = round(took, 2)

    run(go())
    assert_tree_unchanged(folder, before, "run 2 start", outcome)
    assert outcome["run 2 seconds"] < RUN_BOUND
