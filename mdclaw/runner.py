"""Run one agent container for a group and collect what it says.

Public API (the orchestrator and the credential proxy build on it):

* `ContainerRunner(cfg, runtime)` — `await runner.run(folder, ContainerInput(...),
  on_output=callback)` returns a `ContainerResult`; `runner.active(folder)` is the `RunHandle`
  of a running container (`touch()` after sending a follow-up, `close()` to end the
  conversation, `kill()`); `await runner.cleanup_orphans()` at start-up; `await
  runner.aclose()` at shutdown.
* Extra mounts and environment variables: `runner.add_spec_hook(fn)` with
  `fn(ctx: RunContext, spec: RunSpec) -> None` runs before every start and may append to
  `spec.mounts` / set `spec.env` (e.g. ANTHROPIC_BASE_URL);
  `run(..., extra_env=..., extra_mounts=...)` does the same for one run. Never put a secret
  there: the container is the untrusted side (DESIGN invariant 6).
* `parse_container_output(raw)` (last marked block, or "") and `parse_all_outputs(raw)`.

What a run does (seed 004's runContainer): writes the group's agent settings file, removes a
stale `_close`, builds the spec (uid 1000 plus the daemon's group, no network unless the
group says so, all capabilities dropped, no-new-privileges, read-only root with a tmpfs /tmp,
memory/CPU/pids limits, the group/IPC/global/settings mounts and the validated extra
mounts), sends the `ContainerInput` JSON on stdin, and parses output blocks as they stream.
Each block goes to `on_output` at once and resets both timers. The idle timer writes
`ipc/<folder>/input/_close`; the hard timer stops the container and the result says
`timed_out`. Stdout beyond `limits.max_output_bytes` is dropped (and logged) unread.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mdclaw import agentfs
from mdclaw import mounts as mount_rules
from mdclaw.config import Config, validate_folder
from mdclaw.ipc.writers import CLOSE_SENTINEL, remove_close, write_close
from mdclaw.paths import GROUP_DIR_MODE, PROXY_SOCKET_NAME, Layout
from mdclaw.runtime import (
    BOOT_LABEL,
    GROUP_LABEL,
    STDOUT,
    ContainerRuntime,
    Mount,
    RunningContainer,
    RunSpec,
    RuntimeError_,
    install_labels,
)

log = logging.getLogger("mdclaw.runner")

OUTPUT_START = "---NANOCLAW_OUTPUT_START---"
OUTPUT_END = "---NANOCLAW_OUTPUT_END---"
PROXY_MOUNT = "/workspace/proxy"
AGENT_HOME = "/home/node"  # the image's user home; its .claude is the per-group settings dir
STDERR_TAIL_BYTES = 64 * 1024
STOP_GRACE_SECONDS = 2.0

AGENT_SETTINGS: dict[str, Any] = {
    "permissions": {"allow": ["Bash(*)", "Read(*)", "Write(*)", "Edit(*)", "mcp__*"],
                    "deny": []},
    "settings": {"autoApprove": True},
}

OutputCallback = Callable[[str], Awaitable[None] | None]


# --------------------------------------------------------------------------- parsing


def parse_all_outputs(raw: str) -> list[str]:
    """Every text between an OUTPUT_START and the next OUTPUT_END line, in order, stripped."""
    out: list[str] = []
    pos = 0
    while True:
        start = raw.find(OUTPUT_START, pos)
        if start < 0:
            return out
        end = raw.find(OUTPUT_END, start + len(OUTPUT_START))
        if end < 0:
            return out
        out.append(raw[start + len(OUTPUT_START):end].strip())
        pos = end + len(OUTPUT_END)


def parse_container_output(raw: str) -> str:
    """The last marked block in `raw`, or "" when there is none."""
    blocks = parse_all_outputs(raw)
    return blocks[-1] if blocks else ""


class OutputParser:
    """Incremental marker parser over a byte stream, with bounded memory.

    `feed(data)` returns the blocks completed by `data`. Outside a block only enough bytes to
    recognise a split marker are kept; a block longer than `max_block_bytes` is dropped.
    """

    _start = OUTPUT_START.encode()
    _end = OUTPUT_END.encode()

    def __init__(self, max_block_bytes: int) -> None:
        self.max_block_bytes = max_block_bytes
        self.buf = bytearray()
        self.in_block = False
        self.dropped_blocks = 0
        self._skipping = False  # inside an oversized block: discard until its end marker

    def feed(self, data: bytes) -> list[str]:
        blocks: list[str] = []
        self.buf += data
        while True:
            if not self.in_block:
                i = self.buf.find(self._start)
                if i < 0:
                    keep = len(self._start) - 1
                    if len(self.buf) > keep:
                        del self.buf[:len(self.buf) - keep]
                    return blocks
                del self.buf[:i + len(self._start)]
                self.in_block = True
                self._skipping = False
            j = self.buf.find(self._end)
            if j < 0:
                if len(self.buf) > self.max_block_bytes + len(self._end):
                    if not self._skipping:
                        self.dropped_blocks += 1
                        self._skipping = True
                    del self.buf[:len(self.buf) - (len(self._end) - 1)]
                return blocks
            if self._skipping:
                pass
            elif j > self.max_block_bytes:
                self.dropped_blocks += 1
            else:
                blocks.append(self.buf[:j].decode("utf-8", "replace").strip())
            del self.buf[:j + len(self._end)]
            self.in_block = False


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class ContainerInput:
    """What the agent is told on stdin. It has no secrets field, on purpose."""

    prompt: str
    group_folder: str
    chat_jid: str
    is_main: bool = False
    is_scheduled_task: bool = False
    assistant_name: str = "Andy"
    session_id: str | None = None
    backend: str | None = None
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        body: dict[str, Any] = {k: v for k, v in self.extra.items() if k != "secrets"}
        body.update({
            "prompt": self.prompt, "groupFolder": self.group_folder, "chatJid": self.chat_jid,
            "isMain": self.is_main, "isScheduledTask": self.is_scheduled_task,
            "assistantName": self.assistant_name,
        })
        if self.session_id:
            body["sessionId"] = self.session_id
        if self.backend:
            body["backend"] = self.backend
        if self.model:
            body["model"] = self.model
        return json.dumps(body, ensure_ascii=False).encode()


@dataclass
class ContainerResult:
    """How a run ended. `output` is the last block (seed 004's ContainerResult.output)."""

    status: str  # "success" | "error" | "timeout"
    exit_code: int
    timed_out: bool
    outputs: list[str]
    name: str
    error: str | None = None
    closed_idle: bool = False  # the idle timer wrote _close
    oom_killed: bool = False  # the engine says the kernel's OOM killer ended it
    stdout_bytes: int = 0  # everything the container wrote to stdout
    dropped_bytes: int = 0  # stdout beyond max_output_bytes, not kept or parsed
    stderr_tail: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds
    # time.perf_counter() at: call (run entered), start_call (engine asked to start),
    # started (engine answered), eof (output ended: container exited), wait_call/waited
    # (asking the engine for the exit status), done (result built)
    marks: dict[str, float] = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.outputs[-1] if self.outputs else ""


@dataclass(frozen=True)
class RunContext:
    """What a spec hook knows about the run it is adjusting."""

    folder: str
    is_main: bool
    group_dir: Path
    ipc_dir: Path
    cfg: Config


SpecHook = Callable[[RunContext, RunSpec], None]


class RunHandle:
    """A running container, as the orchestrator sees it."""

    def __init__(self, runner: ContainerRunner, folder: str, name: str) -> None:
        self._runner = runner
        self.folder = folder
        self.name = name
        self.container_id: str | None = None
        self.last_activity = time.monotonic()
        self.closed = False
        self._wake = asyncio.Event()

    def touch(self) -> None:
        """Reset the idle timer (call after writing a follow-up into input/)."""
        self.last_activity = time.monotonic()
        self._wake.set()

    def close(self) -> None:
        """Write `_close` now: the agent finishes its turn and exits.

        When the sentinel cannot be written (the container swapped its `input/` folder for a
        symlink or a file), the container is stopped instead.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self._runner.write_close(self.folder)
        except (agentfs.UnsafePath, OSError) as e:
            log.warning("group %s: cannot write _close (%s); stopping its container",
                        self.folder, e)
            self._runner._spawn(self.kill())

    async def kill(self) -> None:
        if self.container_id:
            await asyncio.to_thread(self._runner.runtime.kill, self.container_id)


# --------------------------------------------------------------------------- runner


class ContainerRunner:
    def __init__(self, cfg: Config, runtime: ContainerRuntime) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.layout = Layout(cfg.data_dir)
        self.labels = install_labels(cfg)
        self.boot_id = uuid.uuid4().hex[:12]  # tells our own containers from orphans
        self._hooks: list[SpecHook] = []
        self._active: dict[str, RunHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # ----------------------------------------------------------------- public

    def add_spec_hook(self, hook: SpecHook) -> None:
        """Run `hook(ctx, spec)` before every container start (extra mounts, env)."""
        self._hooks.append(hook)

    def active(self, folder: str) -> RunHandle | None:
        return self._active.get(folder)

    def running(self) -> list[str]:
        """The groups with a container starting or running now."""
        return list(self._active)

    async def cleanup_orphans(self) -> list[str]:
        """Remove containers an earlier run of this install left behind (by label only).

        Containers this runner started itself carry its boot label and are kept, so calling
        this while runs are already under way is safe.
        """

        def sweep() -> list[str]:
            removed = []
            for info in self.runtime.list(dict(self.labels), all=True):
                if info.labels.get(BOOT_LABEL) == self.boot_id:
                    continue
                self.runtime.remove(info.id)
                removed.append(info.name)
            return removed

        removed = await asyncio.to_thread(sweep)
        if removed:
            log.info("removed %d orphaned container(s): %s", len(removed), ", ".join(removed))
        return removed

    async def aclose(self) -> None:
        """Wait for background container removals."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    def write_agent_settings(self, folder: str) -> Path:
        """Write sessions/<folder>/.claude/settings.json (atomically); return its path.

        The folder is the container's to write: it is reached and written through
        `agentfs` (no symlink followed, a random temp name). Raises UnsafePath or OSError.
        """
        data = json.dumps(AGENT_SETTINGS, indent=2).encode()
        with agentfs.opened(self.layout.sessions_dir, folder, ".claude",
                            create=GROUP_DIR_MODE) as fd:
            # No fsync: the file is rewritten before every run, so a crash loses nothing.
            agentfs.atomic_write(fd, "settings.json", data, 0o660, durable=False)
        return self.layout.sessions_dir / folder / ".claude" / "settings.json"

    def write_close(self, folder: str) -> None:
        """Write ipc/<folder>/input/_close. Raises UnsafePath (a swapped folder) or OSError."""
        write_close(self.layout, folder)

    def build_spec(self, folder: str, input: ContainerInput, *,
                   extra_env: dict[str, str] | None = None,
                   extra_mounts: list[Mount] | None = None,
                   command: list[str] | None = None, image: str | None = None) -> RunSpec:
        """The RunSpec for one run of `folder` (also prepares the folders it mounts)."""
        validate_folder(folder)  # it becomes a path and a container name
        cfg = self.cfg
        group = cfg.groups.get(folder)
        is_main = bool(group and group.main) or input.is_main
        lim = cfg.limits
        group_dir = self.layout.group_dir(folder)
        ipc_dir = self.layout.group_ipc_dir(folder)
        agentfs.ensure_group_dirs(self.layout, folder)
        settings = self.write_agent_settings(folder)

        mounts = [
            Mount(str(group_dir), "/workspace/group", readonly=False),
            Mount(str(ipc_dir), "/workspace/ipc", readonly=False),
            Mount(str(self.layout.global_dir), "/workspace/global", readonly=not is_main),
            Mount(str(settings.parent), f"{AGENT_HOME}/.claude", readonly=False),
            # The credential proxy's socket, in a folder the container cannot write.
            Mount(str(self.layout.proxy_dir(folder)), PROXY_MOUNT, readonly=True),
        ]
        for d in mount_rules.group_mounts(cfg, folder):
            if not d.allowed:
                log.warning("group %s: skipping mount %s -> %s: %s", folder, d.request.host,
                            d.container, d.reason)
        for d in mount_rules.granted_mounts(cfg, folder):
            if d.note:
                log.warning("group %s: mount %s: %s", folder, d.request.host, d.note)
            assert d.host is not None
            mounts.append(Mount(d.host, d.container, readonly=d.readonly))
        labels = dict(self.labels)
        labels[GROUP_LABEL] = folder
        labels[BOOT_LABEL] = self.boot_id
        gid = os.getgid()
        spec = RunSpec(
            name=f"mdclaw-{folder}-{int(time.time() * 1000)}",
            image=image or cfg.runtime.image,
            labels=labels,
            command=command,
            stdin=input.to_json(),
            env={"HOME": AGENT_HOME, "TZ": cfg.assistant.timezone, "MDCLAW_GROUP": folder,
                 "MDCLAW_PROXY_SOCKET": f"{PROXY_MOUNT}/{PROXY_SOCKET_NAME}"},
            mounts=mounts,
            user="1000:1000",
            group_add=[str(gid)] if gid != 1000 else [],
            network=(group.network if group and group.network else "none"),
            memory=lim.memory, cpus=lim.cpus, pids=lim.pids,
        )
        ctx = RunContext(folder, is_main, group_dir, ipc_dir, cfg)
        for hook in self._hooks:
            hook(ctx, spec)
        spec.mounts.extend(extra_mounts or ())
        spec.env.update(extra_env or {})
        for key in spec.env:
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"bad environment variable name {key!r}")
        return spec

    async def run(self, folder: str, input: ContainerInput, *,
                  on_output: OutputCallback | None = None,
                  timeout: float | None = None,
                  extra_env: dict[str, str] | None = None,
                  extra_mounts: list[Mount] | None = None,
                  command: list[str] | None = None,
                  image: str | None = None) -> ContainerResult:
        """Run one container for `folder` until it exits or the hard timeout stops it.

        `timeout` (seconds) overrides the group's / the config's hard timeout. Raises
        EngineUnavailable or ImageError (from the runtime) when the container cannot start;
        everything after the start ends in a ContainerResult.
        """
        t_call = time.perf_counter()
        if folder in self._active:
            raise RuntimeError_(f"group {folder} already has a running container")
        cfg = self.cfg
        group = cfg.groups.get(folder)
        hard = timeout if timeout is not None else (
            (group.timeout if group and group.timeout else cfg.limits.container_timeout)
            .total_seconds())
        idle = cfg.limits.idle_timeout.total_seconds()
        if idle >= hard:
            # A group timeout (or a per-run one) at or below the idle timeout: close the
            # conversation before the hard stop rather than never.
            idle = hard * 0.8
        spec = await asyncio.to_thread(self.build_spec, folder, input, extra_env=extra_env,
                                       extra_mounts=extra_mounts, command=command, image=image)
        # A stale sentinel would end this run at once.
        await asyncio.to_thread(remove_close, self.layout, folder)

        handle = RunHandle(self, folder, spec.name)
        self._active[folder] = handle
        try:
            return await self._run(handle, spec, hard, idle, on_output, t_call)
        finally:
            self._active.pop(folder, None)

    # ----------------------------------------------------------------- internals

    async def _run(self, handle: RunHandle, spec: RunSpec, hard: float, idle: float,
                   on_output: OutputCallback | None, t_call: float) -> ContainerResult:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        t_start_call = time.perf_counter()
        starting = asyncio.ensure_future(asyncio.to_thread(self.runtime.start, spec))
        try:
            running = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled while the engine was starting it: remove it once it is there.
            def reap(f: asyncio.Future[RunningContainer]) -> None:
                if not f.cancelled() and f.exception() is None:
                    f.result().close()
                    self._spawn(asyncio.to_thread(_remove_quietly, self.runtime, f.result().id))

            starting.add_done_callback(reap)
            raise
        t_started = time.perf_counter()
        handle.container_id = running.id
        reader = _Reader(running, loop, events, self.cfg.limits.max_output_bytes, spec.name)
        reader.start()

        outputs: list[str] = []
        timed_out = False
        stopping = False
        stop_deadline = 0.0
        eof_at = 0.0
        last_block = time.monotonic()
        handle.last_activity = last_block
        try:
            while True:
                now = time.monotonic()
                hard_left = last_block + hard - now
                idle_left = handle.last_activity + idle - now
                wait = hard_left if (handle.closed or stopping) else min(hard_left, idle_left)
                if stopping:
                    # The engine is stopping it and the stream ends soon; if it does not,
                    # kill it and stop reading rather than hang here.
                    wait = stop_deadline - now
                    if wait <= 0:
                        log.error("container %s did not stop; killing it", spec.name)
                        await asyncio.to_thread(_kill_quietly, self.runtime, running.id)
                        running.close()
                        stop_deadline = now + 30.0
                        continue
                if wait <= 0:
                    if not stopping and hard_left <= 0:
                        timed_out = True
                        stopping = True
                        stop_deadline = now + STOP_GRACE_SECONDS + 30.0
                        log.warning("container %s: no output for %.0f s, stopping it "
                                    "(hard timeout)", spec.name, hard)
                        self._spawn(asyncio.to_thread(self.runtime.stop, running.id,
                                                      STOP_GRACE_SECONDS))
                        continue
                    if not handle.closed and idle_left <= 0:
                        log.info("container %s: idle for %.0f s, writing _close", spec.name,
                                 idle)
                        handle.close()
                        continue
                handle._wake.clear()
                get = asyncio.ensure_future(events.get())
                woke = asyncio.ensure_future(handle._wake.wait())
                done, _ = await asyncio.wait({get, woke}, timeout=max(wait, 0.0),
                                             return_when=asyncio.FIRST_COMPLETED)
                woke.cancel()
                if get not in done:
                    get.cancel()
                    continue
                kind, value = get.result()
                if kind == "block":
                    outputs.append(value)
                    last_block = handle.last_activity = time.monotonic()
                    if on_output is not None:
                        try:
                            r = on_output(value)
                            if inspect.isawaitable(r):
                                await r
                        except Exception:
                            log.exception("output callback for %s failed", spec.name)
                elif kind == "eof":
                    eof_at = value  # when the reader thread saw the stream end
                    break
        except asyncio.CancelledError:
            # Shutdown or a cancelled job: do not leave the container running.
            await asyncio.shield(asyncio.to_thread(_kill_quietly, self.runtime, running.id))
            running.close()
            self._spawn(asyncio.to_thread(_remove_quietly, self.runtime, running.id))
            raise

        error = reader.error
        t_wait = time.perf_counter()
        try:
            exit_code = await asyncio.to_thread(running.wait, 30)
        except RuntimeError_ as e:
            exit_code, error = -1, error or str(e)
        t_waited = time.perf_counter()
        running.close()
        if reader.dropped:
            log.warning("container %s: output cap of %d bytes reached; dropped %d byte(s)",
                        spec.name, self.cfg.limits.max_output_bytes, reader.dropped)
        if reader.parser.dropped_blocks:
            log.warning("container %s: dropped %d oversized output block(s)", spec.name,
                        reader.parser.dropped_blocks)
        status = "timeout" if timed_out else ("success" if exit_code == 0 else "error")
        if status == "error" and error is None:
            error = f"container exited with status {exit_code}"
        result = ContainerResult(
            status=status, exit_code=exit_code, timed_out=timed_out, outputs=outputs,
            name=spec.name, error=error if status != "success" else None,
            closed_idle=handle.closed, stdout_bytes=reader.total, dropped_bytes=reader.dropped,
            stderr_tail=reader.stderr_tail.decode("utf-8", "replace"),
            oom_killed=bool(getattr(running, "oom_killed", False)),
        )
        self._spawn(asyncio.to_thread(_remove_quietly, self.runtime, running.id))
        done_at = time.perf_counter()
        result.marks = {"call": t_call, "start_call": t_start_call, "started": t_started,
                        "eof": eof_at, "wait_call": t_wait, "waited": t_waited,
                        "done": done_at}
        result.timings = {
            "prepare_ms": (t_start_call - t_call) * 1000,
            "engine_start_ms": (t_started - t_start_call) * 1000,
            "exit_to_result_ms": (done_at - eof_at) * 1000,
            "exit_status_ms": (t_waited - t_wait) * 1000,
        }
        log.info("container %s: %s (exit %d%s, %d block(s), %d stdout bytes)", spec.name,
                 status, exit_code, ", OOM-killed" if result.oom_killed else "", len(outputs),
                 reader.total)
        return result

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _Reader(threading.Thread):
    """Reads one container's output in its own thread (a run can last an hour; the loop's
    default executor is small), parses blocks, enforces the output cap, and posts events."""

    def __init__(self, running: RunningContainer, loop: asyncio.AbstractEventLoop,
                 events: asyncio.Queue[tuple[str, Any]], cap: int, name: str) -> None:
        super().__init__(name=f"out-{name}", daemon=True)
        self.running = running
        self.loop = loop
        self.events = events
        self.cap = cap
        self.parser = OutputParser(cap)
        self.total = 0
        self.dropped = 0
        self.stderr_tail = b""
        self.error: str | None = None
        self._stderr_cap = min(cap, STDERR_TAIL_BYTES)

    def _post(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    def run(self) -> None:
        try:
            for stream, data in self.running.chunks():
                if stream != STDOUT:
                    self.stderr_tail = (self.stderr_tail + data)[-self._stderr_cap:]
                    continue
                room = self.cap - self.total
                self.total += len(data)
                if room <= 0:
                    self.dropped += len(data)
                    continue
                if len(data) > room:
                    self.dropped += len(data) - room
                    data = data[:room]
                for block in self.parser.feed(data):
                    self._post("block", block)
        except Exception as e:  # noqa: BLE001 - reported in the result
            self.error = f"reading container output failed: {e}"
        finally:
            self._post("eof", time.perf_counter())


def _kill_quietly(runtime: ContainerRuntime, cid: str) -> None:
    try:
        runtime.kill(cid)
    except Exception as e:  # noqa: BLE001
        log.warning("could not kill container %s: %s", cid[:12], e)


def _remove_quietly(runtime: ContainerRuntime, cid: str) -> None:
    try:
        runtime.remove(cid)
    except Exception as e:  # noqa: BLE001
        log.warning("could not remove container %s: %s", cid[:12], e)


__all__ = ["AGENT_HOME", "AGENT_SETTINGS", "CLOSE_SENTINEL", "OUTPUT_END", "OUTPUT_START",
           "ContainerInput", "ContainerResult", "ContainerRunner", "OutputParser", "RunContext",
           "RunHandle", "SpecHook", "parse_all_outputs", "parse_container_output"]
