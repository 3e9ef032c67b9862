"""The host's MCP servers: one supervisor each, the calls agents and operators make, and what
the operator sees (docs/mcp.md).

- `start`: a supervisor task per server of `mcp_servers`: start it (a stdio server as the
  daemon's own child, never in a container; its `env_files` read on the host at that
  moment), list its tools, write every group's snapshot; when it stops or cannot start, try
  again after a backoff (mdclaw.retry: 1 s doubling to 60 s, reset after a minute up).
  A reload stops the servers whose entry changed or went, starts the new ones and rewrites
  the snapshots. `stop` stops them all.
- `authorize` (on the IPC loop, before a request is queued, and again when it runs): the
  group, the server, the tool and the arguments against the tool's schema. Refused: a
  `Refused` naming the rule.
- `call` (on the action worker): at most `max_concurrent` calls per server and
  `max_concurrent_per_group` per group on it, all within the server's `timeout` (waiting for
  a slot and for the server to be up included); the result converted (mdclaw.mcp.convert),
  secrets taken out, capped. Every failure is an McpError with a message for the agent.
- `status`: each server's state, tools, restarts, the tail of its stderr (secrets taken out)
  and the last calls, for `mdclaw mcp list`, the operator page and /metrics.

The hub the daemon runs is `current()` (install/uninstall), which the `mcp_call` action
(mdclaw/integrations/mcp.py) uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mdclaw import agentfs, metrics, retry
from mdclaw.agentfs import UnsafePath
from mdclaw.config import Config, LiveConfig, McpServer, read_secret
from mdclaw.ipc.writers import write_in_group
from mdclaw.mcp import policy
from mdclaw.mcp.client import McpClient
from mdclaw.mcp.convert import convert, redactor
from mdclaw.mcp.policy import ToolEntry
from mdclaw.mcp.transport import HttpTransport, SocketTransport, StdioTransport, Transport
from mdclaw.mcp.wire import CallTimeout, McpError, Refused, ServerDown
from mdclaw.paths import GROUP_DIR_MODE, Layout
from mdclaw.schedule import to_iso, utc_now

log = logging.getLogger("mdclaw.mcp")

SNAPSHOT = "mcp_tools.json"
STABLE = 60.0  # seconds up after which a restart counts as the first again
RECENT = 50  # calls kept for the operator page
FILE_MODE = 0o660
# Passed to a stdio server from the daemon's own environment; nothing else is.
PASSED_ENV = ("PATH", "LANG", "LC_ALL", "TZ")


@dataclass
class ServerState:
    """One server as the hub runs it."""
    name: str
    spec: McpServer
    state: str = "starting"  # starting, up, down, stopped
    detail: str = ""
    client: McpClient | None = None
    tools: list[ToolEntry] | None = None  # as last listed; None before the first list
    problems: list[str] = field(default_factory=list)
    restarts: int = 0
    up_since: str | None = None
    next_try: float | None = None
    secrets: list[str] = field(default_factory=list)
    stderr: str = ""
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # first start tried
    refreshing: bool = False
    refresh_again: bool = False

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(self.spec.max_concurrent)
        self.group_slots: dict[str, asyncio.Semaphore] = {}
        self.redact = redactor(self.secrets)

    def group_slot(self, folder: str) -> asyncio.Semaphore:
        sem = self.group_slots.get(folder)
        if sem is None:
            sem = self.group_slots[folder] = asyncio.Semaphore(
                self.spec.max_concurrent_per_group)
        return sem

    def set_secrets(self, secrets: list[str]) -> None:
        self.secrets = secrets
        self.redact = redactor(secrets)

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "server": self.name, "kind": self.spec.kind, "state": self.state,
            "detail": self.detail, "restarts": self.restarts, "up_since": self.up_since,
            "tools": [t.name for t in self.tools or []], "problems": self.problems,
            "stderr_tail": self.redact(self.stderr)[-2000:]}
        if self.client is not None:
            out["server_info"] = self.client.server_info
            out["protocol"] = self.client.protocol_version
            out["unasked"] = dict(self.client.stats)
        if self.next_try is not None and self.state == "down":
            out["next_try_in"] = round(max(0.0, self.next_try - time.monotonic()), 1)
        return out


def make_transport(spec: McpServer, data_dir: Path, secrets: dict[str, str]) -> Transport:
    """The transport of `spec`; `secrets`: the values of its env_files / header_files."""
    limit = spec.result_limit
    if spec.command is not None:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env["HOME"] = os.environ.get("HOME") or str(data_dir)
        env.update(spec.env)
        env.update(secrets)
        return StdioTransport(spec.command, list(spec.args), env, spec.cwd, limit)
    if spec.url is not None:
        return HttpTransport(spec.url, {**spec.headers, **secrets}, limit,
                             connect_timeout=min(10.0, spec.start_timeout.total_seconds()))
    assert spec.socket is not None
    return SocketTransport(spec.socket, limit)


def read_secrets(spec: McpServer) -> dict[str, str]:
    """The values of the server's env_files and header_files, read now (blocking). Raises
    ServerDown naming the key (never the value) when one cannot be read."""
    out = {}
    for what, files in (("env_files", spec.env_files), ("header_files", spec.header_files)):
        for key, path in files.items():
            try:
                out[key] = read_secret(path)
            except (OSError, UnicodeDecodeError) as e:
                raise ServerDown(f"cannot read {what}.{key} ({path}): "
                                 f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
    return out


class McpHub:
    def __init__(self, cfg: Config | LiveConfig, *,
                 backoff: retry.Backoff | None = None,
                 snapshots: bool = True) -> None:
        self.live = LiveConfig.of(cfg)
        self.layout = Layout(self.cfg.data_dir)
        self.backoff = backoff or retry.Backoff(base=1.0, cap=60.0)
        self.snapshots = snapshots
        self.servers: dict[str, ServerState] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._stopping = False
        self._snap_lock = asyncio.Lock()
        self._snap_again = False
        self._unsubscribe: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def cfg(self) -> Config:
        return self.live.current

    # ------------------------------------------------------------------ lifecycle
    async def start(self, only: list[str] | None = None) -> None:
        """Start a supervisor for every configured server (or the ones in `only`)."""
        for name, spec in self.cfg.mcp_servers.items():
            if only is None or name in only:
                self._start_server(name, spec)
        if not self.live.fixed:
            self._unsubscribe = self.live.subscribe(self._config_changed)
        if self.snapshots:
            await self.write_snapshots()

    def _start_server(self, name: str, spec: McpServer) -> None:
        st = ServerState(name, spec)
        self.servers[name] = st
        st.task = asyncio.get_running_loop().create_task(self._supervise(st),
                                                         name=f"mcp {name}")

    async def wait_up(self, timeout: float, names: list[str] | None = None) -> bool:
        """Wait until every server (or those named) is up; False when one is not by then."""
        states = [s for n, s in self.servers.items() if names is None or n in names]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(s.ready.wait() for s in states))
        except TimeoutError:
            return False
        return True

    async def wait_settled(self, timeout: float) -> None:
        """Wait until every server is up or has failed its first start."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(s.settled.wait() for s in self.servers.values()))

    async def stop(self) -> None:
        self._stopping = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        await asyncio.gather(*(self._stop_server(s) for s in list(self.servers.values())),
                             return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stop_server(self, st: ServerState) -> None:
        st.stop.set()
        if st.task is not None:
            with contextlib.suppress(BaseException):
                await st.task
        st.state = "stopped"

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _config_changed(self, old: Config, new: Config) -> None:
        if not self._stopping:
            self._spawn(self._apply(new))

    async def _apply(self, new: Config) -> None:
        """A reload: servers whose entry changed or went are stopped, new ones started; the
        snapshots follow the groups' `mcp` lists."""
        for name, st in list(self.servers.items()):
            if new.mcp_servers.get(name) != st.spec:
                log.info("mcp: %s changed or was removed; stopping it", name)
                await self._stop_server(st)
                del self.servers[name]
        for name, spec in new.mcp_servers.items():
            if name not in self.servers and not self._stopping:
                self._start_server(name, spec)
        if self.snapshots:
            await self.write_snapshots()

    async def _supervise(self, st: ServerState) -> None:
        attempt = 0
        while not st.stop.is_set():
            started = time.monotonic()
            client = None
            try:
                secrets = await asyncio.to_thread(read_secrets, st.spec)
                st.set_secrets(list(secrets.values()))
                client = McpClient(st.name, make_transport(st.spec, self.cfg.data_dir, secrets),
                                   on_tools_changed=partial(self._tools_changed, st))
                await client.start(st.spec.start_timeout.total_seconds())
                entries, problems = policy.entries(st.name, client.tools)
            except McpError as e:
                st.state, st.detail = "down", st.redact(str(e))
                if client is not None:
                    st.stderr = client.transport.stderr_tail()
            else:
                st.client, st.tools, st.problems = client, entries, problems
                st.state, st.detail, st.next_try = "up", "", None
                st.up_since = to_iso(utc_now())
                st.ready.set()
                st.settled.set()
                for p in problems:
                    log.warning("mcp: %s: not offered: %s", st.name, p)
                log.info("mcp: %s is up (%s): %d tool(s)", st.name, client.transport.describe,
                         len(entries))
                if self.snapshots:
                    self._spawn(self.write_snapshots())
                closed = asyncio.ensure_future(client.transport.closed.wait())
                stopping = asyncio.ensure_future(st.stop.wait())
                await asyncio.wait({closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
                closed.cancel()
                stopping.cancel()
                st.ready.clear()
                reason = client.transport.reason
                st.stderr = client.transport.stderr_tail()
                await client.close()
                st.client = None
                if st.stop.is_set():
                    break
                st.state, st.detail = "down", st.redact(f"stopped: {reason}")
            st.settled.set()
            if time.monotonic() - started > STABLE:
                attempt = 0
            attempt += 1
            delay = self.backoff.delay(attempt)
            st.next_try = time.monotonic() + delay
            log.warning("mcp: %s: %s; starting it again in %.1f s", st.name, st.detail, delay)
            if await retry.wait(delay, st.stop):
                break
            st.restarts += 1
            metrics.mcp_restarts.get(st.name).inc()
        st.state = "stopped"

    def _tools_changed(self, st: ServerState) -> None:
        if st.refreshing:
            st.refresh_again = True
            return
        st.refreshing = True
        self._spawn(self._refresh(st))

    async def _refresh(self, st: ServerState) -> None:
        try:
            while True:
                st.refresh_again = False
                client = st.client
                if client is None:
                    return
                try:
                    tools = await client.refresh_tools(st.spec.start_timeout.total_seconds())
                except (McpError, TimeoutError) as e:
                    log.warning("mcp: %s: listing its changed tools failed: %s", st.name,
                                st.redact(str(e)))
                    return
                st.tools, st.problems = policy.entries(st.name, tools)
                log.info("mcp: %s changed its tools: %d now", st.name, len(st.tools))
                if self.snapshots:
                    await self.write_snapshots()
                if not st.refresh_again:
                    return
        finally:
            st.refreshing = False

    # ------------------------------------------------------------------ snapshots
    def catalog(self) -> dict[str, list[ToolEntry]]:
        return {n: list(s.tools or []) for n, s in self.servers.items()}

    async def write_snapshots(self) -> None:
        """Write each configured group's `mcp_tools.json` (coalesced; on a thread)."""
        if self._snap_lock.locked():
            self._snap_again = True
            return
        async with self._snap_lock:
            while True:
                self._snap_again = False
                await asyncio.to_thread(self._write_snapshots, self.cfg, self.catalog())
                if not self._snap_again:
                    return

    def _write_snapshots(self, cfg: Config, catalog: dict[str, list[ToolEntry]]) -> None:
        for folder in cfg.groups:
            body = policy.snapshot(cfg, folder, catalog)
            data = (json.dumps(body, ensure_ascii=False) + "\n").encode()
            try:
                write_in_group(self.layout, folder, None, SNAPSHOT, data)
            except (OSError, UnsafePath) as e:
                log.debug("mcp: no tool snapshot for %s: %s", folder, e)

    # ------------------------------------------------------------------ calls
    def authorize(self, folder: str, params: dict[str, Any]) -> tuple[ServerState, ToolEntry,
                                                                     dict[str, Any]]:
        """The server, tool and arguments of an mcp_call of group `folder`; Refused naming
        the rule that refuses it. Quick and I/O-free (it runs on the IPC loop)."""
        server, tool = params.get("server"), params.get("tool")
        args = params.get("arguments", {})
        if not isinstance(server, str) or not isinstance(tool, str) or \
                not isinstance(args, dict):
            raise Refused("mcp_call needs `server` and `tool` (strings) and `arguments` (an "
                          "object)")
        st = self.servers.get(server)
        known = st.tools if st is not None else None
        why = policy.refusal(self.cfg, folder, server, tool, known)
        if why is not None:
            raise Refused(why)
        if st is None or known is None:
            state = f"{st.state}: {st.detail}" if st is not None and st.detail else \
                (st.state if st is not None else "not started")
            raise ServerDown(f"MCP server {server!r} has not listed its tools yet ({state}); "
                             "try again shortly")
        entry = next(t for t in known if t.name == tool)
        problems = policy.argument_problems(entry.input_schema, args)
        if problems:
            raise Refused(f"the arguments of {entry.offered} break its input schema: "
                          + "; ".join(problems))
        return st, entry, args

    async def call(self, folder: str, params: dict[str, Any], *,
                   who: str | None = None) -> dict[str, Any]:
        """Run one call for group `folder` (see the module doc); the converted result.
        Raises McpError with a message for the agent."""
        started = time.monotonic()
        server = str(params.get("server"))
        tool_label = "other"
        outcome = "ok"
        record: dict[str, Any] = {"at": to_iso(utc_now()), "group": folder, "server": server,
                                  "tool": str(params.get("tool"))[:100]}
        if who:
            record["by"] = who
        try:
            st, entry, args = self.authorize(folder, params)
            tool_label = entry.name
            timeout = st.spec.timeout.total_seconds()
            try:
                async with asyncio.timeout(timeout):
                    async with st.slots, st.group_slot(folder):
                        while True:
                            client = st.client
                            if client is not None and client.is_up:
                                break
                            if st.stop.is_set():
                                raise ServerDown(f"MCP server {server!r} was stopped")
                            if st.state == "down" and (st.next_try is None or
                                                       st.next_try > started + timeout):
                                raise ServerDown(f"MCP server {server!r} is down: "
                                                 f"{st.detail or 'not started'}")
                            if st.ready.is_set():  # going down: the supervisor clears it
                                await asyncio.sleep(0.05)
                            else:
                                with contextlib.suppress(TimeoutError):
                                    await asyncio.wait_for(st.ready.wait(), 0.25)
                        began = time.monotonic()
                        left = timeout - (began - started)
                        raw = await client.call_tool(entry.name, args, max(left, 0.001))
                        record["server_seconds"] = round(time.monotonic() - began, 6)
            except (TimeoutError, CallTimeout):
                # One deadline, one message: the call's own bound (what was left of it) and
                # this one end at the same instant, and either may fire first.
                raise CallTimeout(f"{entry.offered} got no result within {timeout:g} s "
                                  f"(mcp_servers.{server}.timeout)") from None
            result = await asyncio.to_thread(
                convert, server, entry.name, raw, max_chars=st.spec.result_limit,
                save=partial(self._save, folder), redact=st.redact)
            outcome = "tool_error" if result["isError"] else "ok"
            return result
        except McpError as e:
            outcome = e.outcome
            st_ = self.servers.get(server)
            message = st_.redact(str(e)) if st_ is not None else str(e)
            record["error"] = message[:300]
            raise type(e)(message) from None
        finally:
            took = time.monotonic() - started
            record.update(outcome=outcome, seconds=round(took, 6))
            self.recent.appendleft(record)
            metrics.mcp_calls.get(server if server in self.servers else "other", tool_label,
                                  outcome).inc()
            if tool_label != "other":
                metrics.mcp_call.get(server, tool_label).observe(took)

    def _save(self, folder: str, data: bytes, mime: str, name: str) -> str:
        """Write a tool's binary output into groups/<folder>/mcp/<day>/ (blocking)."""
        day = to_iso(utc_now())[:10]
        used = agentfs.write_new_file(self.layout.groups_dir, (folder, "mcp", day), name, data,
                                      len(data) + 1, mode=FILE_MODE, dir_mode=GROUP_DIR_MODE)
        return f"/workspace/group/mcp/{day}/{used}"

    # ------------------------------------------------------------------ status
    def status(self) -> list[dict[str, Any]]:
        out = []
        for st in self.servers.values():
            tail = st.client.transport.stderr_tail() if st.client is not None else ""
            if tail:  # else the last one kept: what a server said before it died
                st.stderr = tail
            out.append(st.view())
        return out

    def annotations(self, server: str, tool: str) -> dict[str, Any]:
        """The tool's annotations as the server last listed them ({}: not known)."""
        st = self.servers.get(server)
        entry = next((t for t in (st.tools or []) if t.name == tool), None) if st else None
        return entry.annotations if entry else {}

    def needs_approval(self, server: str, tool: str) -> bool:
        return policy.needs_approval(self.cfg, server, tool, self.annotations(server, tool))


_current: McpHub | None = None


def install(hub: McpHub | None) -> None:
    """Make `hub` the one the mcp_call action uses (None: none)."""
    global _current
    _current = hub


def current() -> McpHub | None:
    return _current


__all__ = ["McpHub", "ServerState", "current", "install", "make_transport", "read_secrets"]
