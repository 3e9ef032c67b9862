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
  there: the container is the untrusted side, and secrets never enter it (the model key
  is added by the host's credential proxy).
* `parse_container_output(raw)` (last marked block, or "") and `parse_all_outputs(raw)`.

What a run does: writes the group's agent settings file, removes a stale `_close`, builds
the spec (uid 1000 plus the daemon's group, no network unless the group says so, all
capabilities dropped, no-new-privileges, read-only root with a tmpfs /tmp, memory/CPU/pids
limits, the group/IPC/global/settings mounts and the validated extra mounts), sends the
`ContainerInput` JSON on stdin (the contract is mdclaw.wire), and cuts output blocks out of
the stream as they come. Each block goes to `on_output` at once and resets both timers. The
idle timer writes `ipc/<folder>/input/_close`; the hard timer stops the container and the
result says `timed_out`. Stdout beyond `limits.max_output_bytes` is dropped (and logged) unread.
`RunTimers` holds the timers and their rules without any I/O; `_RunLoop` only waits for the
next output event or deadline and does what `RunTimers.due()` says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
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

from mdclaw import agentfs, metrics
from mdclaw import mounts as mount_rules
from mdclaw.aio import wait_all
from mdclaw.config import Config, LiveConfig, validate_folder
from mdclaw.integrations import load_all
from mdclaw.ipc.actions import ACTIONS, action_refusal
from mdclaw.ipc.writers import CLOSE_SENTINEL, remove_close, write_close
from mdclaw.paths import GROUP_DIR_MODE, PROXY_SOCKET_NAME, Layout
from mdclaw.runtime import (
    BOOT_LABEL,
    GROUP_LABEL,
    STDOUT,
    ContainerRuntime,
    EngineCallError,
    EngineUnavailable,
    ImageError,
    Mount,
    RunningContainer,
    RunSpec,
    engine_errors,
    install_labels,
)
from mdclaw.wire import OUTPUT_END, OUTPUT_START, ContainerInput

log = logging.getLogger("mdclaw.runner")

PROXY_MOUNT = "/workspace/proxy"
AGENT_HOME = "/home/node"  # the image's user home; its .claude is the per-group settings dir
STDERR_TAIL_BYTES = 64 * 1024
STOP_GRACE_SECONDS = 2.0  # the engine's own SIGTERM-to-SIGKILL wait when the hard timer fires
# After a stop's grace, or after a kill, how long the output stream gets to end before the
# container is killed (again); a stream that never ends must not hang the run.
STOP_WAIT_SECONDS = 30.0
# A container created ahead of a group's next run (`runtime.keep_created`) is removed when no
# run has used it for this long.
SPARE_TTL_SECONDS = 600.0

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


def allowed_actions(cfg: Config, folder: str, is_main: bool) -> list[str]:
    """The host actions group `folder` may call (the one rule, `action_refusal`), which its
    container's tools offer: passed as MDCLAW_ACTIONS."""
    load_all()
    return sorted(n for n in ACTIONS if action_refusal(cfg, folder, is_main, n) is None)


@dataclass
class ContainerResult:
    """How a run ended. `output` is the last block: the agent's final answer."""

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
class RunLimits:
    """What bounds one run, from the config in force when it starts (a reload meanwhile
    applies from the group's next run)."""

    hard_timeout: float  # seconds: the container is stopped after this long
    idle_timeout: float  # seconds without output or follow-up: the conversation is closed
    max_output_bytes: int  # stdout kept; the rest is dropped unread


@dataclass(frozen=True)
class RunContext:
    """What a spec hook knows about the run it is adjusting."""

    folder: str
    is_main: bool
    group_dir: Path
    ipc_dir: Path
    cfg: Config


SpecHook = Callable[[RunContext, RunSpec], None]


class Due(enum.Enum):
    """What a run's timers call for at one moment (`RunTimers.due`)."""

    NOTHING = "nothing"
    CLOSE_IDLE = "close_idle"  # no output and no follow-up for `idle` s: write _close
    STOP_HARD = "stop_hard"  # no output for `hard` s: stop the container (timed out)
    KILL_UNSTOPPED = "kill_unstopped"  # a stop (or kill) did not end the output in time


class RunTimers:
    """The idle and hard timers of one run and the stop-then-kill escalation, as plain state.

    No I/O and no asyncio: every event and question takes `now` (seconds on a monotonic
    clock), so the rules are tested with a fake clock. The run's loop reports events
    (`on_started`, `on_block`, `on_stop_requested`, `on_kill_sent`), the `RunHandle` reports
    follow-ups (`on_touch`) and `_close` (`on_close`), and the loop asks `due(now)` what to do
    and `wait_seconds(now)` how long it may wait for the next output event.

    * The hard timer ends `hard` s after the last output block (or the start). Only output
      resets it: a follow-up does not keep a silent container alive.
    * The idle timer ends `idle` s after the last output block or follow-up, and stops
      counting once the conversation is closed, whoever closed it. An `idle` at or above
      `hard` becomes `hard * 0.8`.
    * Once the hard timer has fired (`timed_out`), the container is being stopped and only
      the stop deadline counts: `STOP_GRACE_SECONDS + STOP_WAIT_SECONDS` after the stop was
      asked for, then `STOP_WAIT_SECONDS` after each kill, until the output ends.
    """

    def __init__(self, hard: float, idle: float, now: float) -> None:
        self.hard = hard
        if idle >= hard:
            # A group timeout (or a per-run one) at or below the idle timeout: close the
            # conversation before the hard stop rather than never.
            idle = hard * 0.8
        self.idle = idle
        self.last_block = now  # the last output block, or the start
        self.last_activity = now  # the last output block or follow-up, or the start
        self.closed = False  # _close was written (or its writing attempted)
        self.timed_out = False  # the hard timer fired; the container is being stopped
        self.stop_deadline = 0.0  # while timed_out: when to kill it (again)

    # ------------------------------------------------------------------ events

    def on_started(self, now: float) -> None:
        """The container is running: both timers count from `now`."""
        self.last_block = self.last_activity = now

    def on_block(self, now: float) -> None:
        """An output block arrived: both timers start again."""
        self.last_block = self.last_activity = now

    def on_touch(self, now: float) -> None:
        """A follow-up was sent: the idle timer starts again (the hard timer does not)."""
        self.last_activity = now

    def on_close(self) -> None:
        """The conversation was closed: from now on only the hard timer counts."""
        self.closed = True

    def on_stop_requested(self, now: float) -> None:
        """The engine was asked to stop the container because the hard timer fired."""
        self.timed_out = True
        self.stop_deadline = now + STOP_GRACE_SECONDS + STOP_WAIT_SECONDS

    def on_kill_sent(self, now: float) -> None:
        """The container was killed because a stop (or kill) did not end its output."""
        self.stop_deadline = now + STOP_WAIT_SECONDS

    # ------------------------------------------------------------------ questions

    @property
    def hard_deadline(self) -> float:
        """When the hard timer fires unless output comes first."""
        return self.last_block + self.hard

    @property
    def idle_deadline(self) -> float:
        """When the idle timer fires unless output or a follow-up comes first."""
        return self.last_activity + self.idle

    def next_deadline(self) -> float:
        """The earliest moment at which `due` can say something other than NOTHING."""
        if self.timed_out:
            return self.stop_deadline
        if self.closed:
            return self.hard_deadline
        return min(self.hard_deadline, self.idle_deadline)

    def wait_seconds(self, now: float) -> float:
        """How long the loop may wait for output before asking `due` again (never < 0)."""
        return max(self.next_deadline() - now, 0.0)

    def due(self, now: float) -> Due:
        """What to do at `now`. The hard timer wins over the idle timer when both are due;
        while the container is being stopped only the kill can be due."""
        if self.timed_out:
            return Due.KILL_UNSTOPPED if now >= self.stop_deadline else Due.NOTHING
        if now >= self.hard_deadline:
            return Due.STOP_HARD
        if not self.closed and now >= self.idle_deadline:
            return Due.CLOSE_IDLE
        return Due.NOTHING


class RunHandle:
    """A running container, as the orchestrator sees it."""

    def __init__(self, runner: ContainerRunner, folder: str, name: str,
                 timers: RunTimers, max_output_bytes: int = 10 * 1024 * 1024) -> None:
        self._runner = runner
        self.folder = folder
        self.name = name
        self.container_id: str | None = None
        self.timers = timers
        self.max_output_bytes = max_output_bytes
        self._wake = asyncio.Event()  # set by touch(): the run's loop recomputes its wait

    @property
    def closed(self) -> bool:
        """True once `close()` has run (by the idle timer or by the orchestrator)."""
        return self.timers.closed

    @property
    def last_activity(self) -> float:
        """time.monotonic() of the last output block or follow-up (or the start)."""
        return self.timers.last_activity

    def touch(self) -> None:
        """Reset the idle timer (call after writing a follow-up into input/)."""
        self.timers.on_touch(time.monotonic())
        self._wake.set()

    def close(self) -> None:
        """Write `_close` now: the agent finishes its turn and exits. Does nothing the second
        time; never raises.

        When the sentinel cannot be written (the container swapped its `input/` folder for a
        symlink or a file), the container is stopped instead.
        """
        if self.closed:
            return
        self.timers.on_close()
        try:
            self._runner.write_close(self.folder)
        except (agentfs.UnsafePath, OSError) as e:
            log.warning("group %s: cannot write _close (%s); stopping its container",
                        self.folder, e)
            self._runner._spawn(self.kill())

    async def kill(self) -> None:
        """SIGKILL the container now; does nothing before it has started. Raises what the
        runtime's `kill` raises (EngineCallError, EngineUnavailable)."""
        if self.container_id:
            await asyncio.to_thread(self._runner.runtime.kill, self.container_id)


# --------------------------------------------------------------------------- runner


class ContainerRunner:
    """Runs containers for groups. The config (a LiveConfig, or a plain Config that never
    changes) is read when a run is built: a reload applies from each group's next run."""

    def __init__(self, cfg: Config | LiveConfig, runtime: ContainerRuntime) -> None:
        self.live = LiveConfig.of(cfg)
        cfg = self.live.current
        self.runtime = runtime
        self.layout = Layout(cfg.data_dir)
        self.labels = install_labels(cfg)
        self.boot_id = uuid.uuid4().hex[:12]  # tells our own containers from orphans
        self._hooks: list[SpecHook] = []
        self._active: dict[str, RunHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # Per group, the container created (not started) for its next run, or being created.
        self._spares: dict[str, _Spare] = {}
        self._closing = False

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    # ----------------------------------------------------------------- public

    def add_spec_hook(self, hook: SpecHook) -> None:
        """Run `hook(ctx, spec)` before every container start (extra mounts, env)."""
        self._hooks.append(hook)

    def active(self, folder: str) -> RunHandle | None:
        """The handle of `folder`'s starting or running container, or None."""
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
        """Remove the containers created ahead of time; wait for background removals."""
        self._closing = True
        for folder in list(self._spares):
            self._discard(self._spares.pop(folder))
        await wait_all(self._background)

    def spare(self, folder: str) -> str | None:
        """The name of the container created ahead of `folder`'s next run, or None."""
        spare = self._spares.get(folder)
        return spare.name if spare is not None and spare.id else None

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

    def run_limits(self, folder: str, timeout: float | None = None) -> RunLimits:
        """The limits a run of `folder` starting now gets: `timeout` (seconds), else the
        group's `timeout`, else limits.container_timeout; limits.idle_timeout and
        limits.max_output_bytes."""
        cfg = self.cfg
        group = cfg.groups.get(folder)
        hard = timeout if timeout is not None else (
            (group.timeout if group and group.timeout else cfg.limits.container_timeout)
            .total_seconds())
        return RunLimits(hard, cfg.limits.idle_timeout.total_seconds(),
                         cfg.limits.max_output_bytes)

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
                 "MDCLAW_PROXY_SOCKET": f"{PROXY_MOUNT}/{PROXY_SOCKET_NAME}",
                 "MDCLAW_TOOL_TIMEOUT_MAX": f"{cfg.tool_timeout_seconds(folder):g}",
                 "MDCLAW_ACTIONS": ",".join(allowed_actions(cfg, folder, is_main))},
            mounts=mounts,
            user="1000:1000",
            group_add=[str(gid)] if gid != 1000 else [],
            network=cfg.network_for(folder),
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
            raise EngineCallError(f"group {folder} already has a running container")
        limits = self.run_limits(folder, timeout)
        timers = RunTimers(limits.hard_timeout, limits.idle_timeout, time.monotonic())
        spec = await asyncio.to_thread(self.build_spec, folder, input, extra_env=extra_env,
                                       extra_mounts=extra_mounts, command=command, image=image)
        # A stale sentinel would end this run at once.
        await asyncio.to_thread(remove_close, self.layout, folder)
        # Only the ordinary run of a group has a container made ahead of time.
        plain = not (extra_env or extra_mounts or command or image)
        created = await self._claim_spare(folder, spec) if plain else None
        if not plain and folder in self._spares:
            self._discard(self._spares.pop(folder))

        handle = RunHandle(self, folder, spec.name, timers, limits.max_output_bytes)
        self._active[folder] = handle
        try:
            return await self._run(handle, spec, on_output, t_call, created)
        finally:
            self._active.pop(folder, None)
            if plain:
                self._keep_ready(folder, input)

    # ----------------------------------------------------------------- internals

    async def _run(self, handle: RunHandle, spec: RunSpec, on_output: OutputCallback | None,
                   t_call: float, created: str | None = None) -> ContainerResult:
        """Start the container, follow it until its output ends, and give its result.

        Raises what the runtime's `start` raises. When cancelled, kills and removes the
        container (also one still starting) and raises CancelledError.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        t_start_call = time.perf_counter()
        try:
            running = await self._start(spec, created)
        except Exception:
            metrics.container_starts.get("failed").inc()
            raise
        t_started = time.perf_counter()
        metrics.container_starts.get("started").inc()
        metrics.CONTAINER_START.observe(t_started - t_start_call)
        handle.container_id = running.id
        reader = _Reader(running, loop, events, handle.max_output_bytes, spec.name)
        reader.start()
        handle.timers.on_started(time.monotonic())
        followed = _RunLoop(self, handle, running, events, spec.name, on_output)
        try:
            await followed.until_eof()
        except asyncio.CancelledError:
            # Shutdown or a cancelled job: do not leave the container running.
            await asyncio.shield(asyncio.to_thread(_kill_quietly, self.runtime, running.id))
            running.close()
            self._spawn(asyncio.to_thread(_remove_quietly, self.runtime, running.id))
            raise
        return await self._finish(handle, spec, running, reader, followed.outputs, {
            "call": t_call, "start_call": t_start_call, "started": t_started,
            "eof": followed.eof_at})

    def _start_now(self, spec: RunSpec, created: str | None) -> RunningContainer:
        """Start the container created ahead of time (`created`), or create and start one.
        A created container the engine cannot start (removed behind our back) is replaced
        by a new one; an unreachable engine or a missing image is raised."""
        if created is not None:
            try:
                return self.runtime.start_created(created, spec)
            except (EngineUnavailable, ImageError):
                raise
            except EngineCallError as e:
                log.warning("container %s created ahead of time did not start (%s); creating "
                            "a new one", spec.name, e)
                spec.name = f"mdclaw-{spec.labels.get(GROUP_LABEL, 'x')}-" \
                            f"{int(time.time() * 1000)}"
        return self.runtime.start(spec)

    async def _start(self, spec: RunSpec, created: str | None = None) -> RunningContainer:
        """The started container. Raises what the runtime's `start` raises; when cancelled
        while the engine is starting it, removes it once it is there and raises
        CancelledError."""
        starting = asyncio.ensure_future(asyncio.to_thread(self._start_now, spec, created))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            # Cancelled while the engine was starting it: remove it once it is there.
            def reap(f: asyncio.Future[RunningContainer]) -> None:
                if not f.cancelled() and f.exception() is None:
                    f.result().close()
                    self._spawn(asyncio.to_thread(_remove_quietly, self.runtime, f.result().id))

            starting.add_done_callback(reap)
            raise

    async def _finish(self, handle: RunHandle, spec: RunSpec, running: RunningContainer,
                      reader: _Reader, outputs: list[str],
                      marks: dict[str, float]) -> ContainerResult:
        """The result of a run whose output has ended: asks the engine for the exit status
        (an engine error becomes exit code -1 and the result's error), then has the container
        removed in the background. `marks` has call, start_call, started and eof; the
        result's marks add wait_call, waited and done. Never raises for an engine error."""
        error = reader.error
        t_wait = time.perf_counter()
        try:
            exit_code = await asyncio.to_thread(running.wait, 30)
        except EngineCallError as e:
            exit_code, error = -1, error or str(e)
        t_waited = time.perf_counter()
        running.close()
        if reader.dropped:
            log.warning("container %s: output cap of %d bytes reached; dropped %d byte(s)",
                        spec.name, handle.max_output_bytes, reader.dropped)
        if reader.parser.dropped_blocks:
            log.warning("container %s: dropped %d oversized output block(s)", spec.name,
                        reader.parser.dropped_blocks)
        timed_out = handle.timers.timed_out
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
        metrics.container_run.get(status).observe(done_at - marks["started"])
        m = result.marks = {**marks, "wait_call": t_wait, "waited": t_waited, "done": done_at}
        result.timings = {
            "prepare_ms": (m["start_call"] - m["call"]) * 1000,
            "engine_start_ms": (m["started"] - m["start_call"]) * 1000,
            "exit_to_result_ms": (done_at - m["eof"]) * 1000,
            "exit_status_ms": (t_waited - t_wait) * 1000,
        }
        log.info("container %s: %s (exit %d%s, %d block(s), %d stdout bytes)", spec.name,
                 status, exit_code, ", OOM-killed" if result.oom_killed else "", len(outputs),
                 reader.total)
        return result

    # ------------------------------------------------------- containers made ahead of time

    def _keep_ready(self, folder: str, input: ContainerInput) -> None:
        """Create (not start) the container of `folder`'s next run in the background, so that
        run only attaches and starts it. Its spec is built like a run's (same mounts,
        environment, labels, limits: never a secret, see build_spec); the prompt goes in
        on stdin when it starts. Removed after SPARE_TTL_SECONDS unused, when the group's
        spec changed by then (`_claim_spare`), at shutdown, and by the next daemon's orphan
        cleanup (it carries this runner's boot label)."""
        if (self._closing or folder in self._spares or not self.cfg.runtime.keep_created
                or not self.runtime.supports_create):
            return
        spare = _Spare()
        spare.task = asyncio.ensure_future(self._create_spare(folder, input, spare))
        self._spares[folder] = spare

    async def _create_spare(self, folder: str, input: ContainerInput, spare: _Spare) -> None:
        try:
            spec = await asyncio.to_thread(self.build_spec, folder, input)
            spare.key, spare.name = _spec_key(spec), spec.name
            spare.id = await asyncio.to_thread(self.runtime.create, spec)
        except Exception as e:  # noqa: BLE001 - an optimisation: the next run creates its own
            log.info("group %s: no container created ahead of time: %s", folder, e)
            if self._spares.get(folder) is spare:
                del self._spares[folder]
            return
        if spare.claimed:
            return  # a run took it while it was being created: that run starts it
        if self._closing or self._spares.get(folder) is not spare:
            self._discard(spare)
            return
        log.debug("group %s: container %s created for the next run", folder, spare.name)
        spare.expiry = asyncio.get_running_loop().call_later(
            SPARE_TTL_SECONDS, self._expire, folder, spare)

    def _expire(self, folder: str, spare: _Spare) -> None:
        if self._spares.get(folder) is spare:
            del self._spares[folder]
            log.info("group %s: removing container %s created ahead of time (unused for %.0f "
                     "s)", folder, spare.name, SPARE_TTL_SECONDS)
            self._discard(spare)

    async def _claim_spare(self, folder: str, spec: RunSpec) -> str | None:
        """The id of `folder`'s container created ahead of time when it was made from a spec
        equal to `spec` (but for name and stdin); `spec.name` then becomes its name. A spare
        from different settings (the config was reloaded, a mount granted or revoked, the
        image or limits changed) is removed and None returned."""
        spare = self._spares.pop(folder, None)
        if spare is None:
            return None
        spare.claimed = True  # from here on this run starts or removes it, nobody else
        if spare.expiry is not None:
            spare.expiry.cancel()
        assert spare.task is not None
        try:
            await asyncio.shield(spare.task)  # still being created: that is the quicker way
        except asyncio.CancelledError:
            self._discard(spare)
            raise
        if spare.id is None:
            return None
        if not self.cfg.runtime.keep_created:  # turned off by a reload since
            self._discard(spare)
            return None
        if spare.key != _spec_key(spec):
            log.info("group %s: the container created ahead of time (%s) no longer matches "
                     "the group's settings; removing it", folder, spare.name)
            self._discard(spare)
            return None
        spec.name = spare.name
        return spare.id

    def _discard(self, spare: _Spare) -> None:
        """Remove a spare container, once its creation (if under way) has ended."""
        if spare.expiry is not None:
            spare.expiry.cancel()

        async def remove() -> None:
            if spare.task is not None:
                await asyncio.gather(spare.task, return_exceptions=True)
            if spare.id is not None:
                await asyncio.to_thread(_remove_quietly, self.runtime, spare.id)
                spare.id = None

        self._spawn(remove())

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class _RunLoop:
    """One started container, followed until its output ends: each output block goes to the
    callback, and whatever the run's `RunTimers` say is due is done, one method each."""

    def __init__(self, runner: ContainerRunner, handle: RunHandle, running: RunningContainer,
                 events: asyncio.Queue[tuple[str, Any]], name: str,
                 on_output: OutputCallback | None) -> None:
        self.runner = runner
        self.handle = handle
        self.timers = handle.timers
        self.running = running
        self.events = events  # ("block", text) and finally ("eof", perf_counter) from _Reader
        self.name = name
        self.on_output = on_output
        self.outputs: list[str] = []
        self.eof_at = 0.0  # time.perf_counter() when the reader saw the output end

    async def until_eof(self) -> None:
        """Return when the output has ended (`outputs` and `eof_at` are then final).

        Raises CancelledError when cancelled; the caller kills the container.
        """
        while True:
            now = time.monotonic()
            due = self.timers.due(now)
            if due is Due.KILL_UNSTOPPED:
                await self._kill_unstopped(now)
            elif due is Due.STOP_HARD:
                self._stop_hard(now)
            elif due is Due.CLOSE_IDLE:
                self._close_idle()
            else:
                event = await self._next_event(self.timers.wait_seconds(now))
                if event is None:  # a deadline came, or a follow-up moved one: look again
                    continue
                kind, value = event
                if kind == "block":
                    await self._on_block(value)
                elif kind == "eof":
                    self.eof_at = value
                    return

    async def _next_event(self, timeout: float) -> tuple[str, Any] | None:
        """The reader's next event, or None when `timeout` passed or `touch()` woke us."""
        self.handle._wake.clear()
        get = asyncio.ensure_future(self.events.get())
        woke = asyncio.ensure_future(self.handle._wake.wait())
        done, _ = await asyncio.wait({get, woke}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        woke.cancel()
        if get not in done:
            get.cancel()
            return None
        return get.result()

    async def _on_block(self, text: str) -> None:
        """Keep the block, restart both timers, and hand it to the output callback."""
        self.outputs.append(text)
        self.timers.on_block(time.monotonic())
        if self.on_output is None:
            return
        try:
            r = self.on_output(text)
            if inspect.isawaitable(r):
                await r
        except Exception:  # noqa: BLE001 - a failing callback must not end the run; logged
            log.exception("output callback for %s failed", self.name)

    def _close_idle(self) -> None:
        """The idle timer fired: write `_close` so the agent finishes and exits."""
        log.info("container %s: idle for %.0f s, writing _close", self.name, self.timers.idle)
        self.handle.close()

    def _stop_hard(self, now: float) -> None:
        """The hard timer fired: ask the engine to stop the container (in the background);
        the result will say timed_out."""
        self.timers.on_stop_requested(now)
        log.warning("container %s: no output for %.0f s, stopping it (hard timeout)",
                    self.name, self.timers.hard)
        self.runner._spawn(asyncio.to_thread(self.runner.runtime.stop, self.running.id,
                                             STOP_GRACE_SECONDS))

    async def _kill_unstopped(self, now: float) -> None:
        """The stop did not end the output in time: kill the container and release its
        stream, so the reader ends rather than the run hanging here."""
        log.error("container %s did not stop; killing it", self.name)
        await asyncio.to_thread(_kill_quietly, self.runner.runtime, self.running.id)
        self.running.close()
        self.timers.on_kill_sent(now)


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


class _Spare:
    """A container created ahead of a group's next run (or being created by `task`)."""

    def __init__(self) -> None:
        self.task: asyncio.Future[None] | None = None
        self.key = ""  # _spec_key of the spec it was created from
        self.name = ""
        self.id: str | None = None  # set once the engine created it
        self.expiry: asyncio.TimerHandle | None = None
        self.claimed = False  # a run took it (maybe while it was still being created)


def _spec_key(spec: RunSpec) -> str:
    """Everything a created container fixes (all of the spec but its name and stdin)."""
    d = dataclasses.asdict(spec)
    d.pop("name")
    d.pop("stdin")
    return json.dumps(d, sort_keys=True, default=str)


def _kill_quietly(runtime: ContainerRuntime, cid: str) -> None:
    """SIGKILL the container. An engine error (`runtime.engine_errors()`) is logged, not
    raised; anything else is a bug and propagates."""
    try:
        runtime.kill(cid)
    except engine_errors() as e:
        log.warning("could not kill container %s: %s", cid[:12], e)


def _remove_quietly(runtime: ContainerRuntime, cid: str) -> None:
    """Remove the container. An engine error (`runtime.engine_errors()`) is logged, not
    raised; anything else is a bug and propagates."""
    try:
        runtime.remove(cid)
    except engine_errors() as e:
        log.warning("could not remove container %s: %s", cid[:12], e)


__all__ = ["AGENT_HOME", "AGENT_SETTINGS", "CLOSE_SENTINEL", "OUTPUT_END", "OUTPUT_START",
           "ContainerInput", "ContainerResult", "ContainerRunner", "Due", "OutputParser",
           "RunContext", "RunHandle", "RunTimers", "SpecHook", "parse_all_outputs",
           "parse_container_output"]
