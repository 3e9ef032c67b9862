"""One connection to one MCP server: the handshake, the tool list, calls, and what the server
sends unasked.

- `start`: open the transport, `initialize` (protocol revision from wire.PROTOCOL_VERSIONS,
  no client capability at all: no sampling, roots or elicitation), `notifications/
  initialized`, then `tools/list` (every page, at most MAX_TOOLS tools).
- `call_tool`: `tools/call` with a deadline; past it the server is sent
  `notifications/cancelled` and the caller gets CallTimeout. A server that goes away fails
  every call in flight at once (ServerCrashed), never a hang.
- Unasked messages (notifications, requests, lines that are not JSON-RPC) are handled as
  they come, never queued: `ping` is answered, every other request gets "method not found",
  `notifications/tools/list_changed` calls `on_tools_changed`, the rest is dropped. More
  than `unsolicited_limit` in a window of WINDOW seconds are dropped unread; ten times that
  many and the connection is closed (the hub restarts the server with backoff).
- Messages of 64 KiB or more are parsed on a thread, so a large result never holds the
  daemon's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from mdclaw.mcp.transport import Transport
from mdclaw.mcp.wire import (
    CLIENT_CAPABILITIES,
    CLIENT_INFO,
    METHOD_NOT_FOUND,
    PROTOCOL_VERSIONS,
    CallTimeout,
    McpError,
    Oversize,
    ProtocolFailure,
    ServerCrashed,
    TooLarge,
    error_response,
    error_text,
    kind,
    notification,
    request,
    response,
)

log = logging.getLogger("mdclaw.mcp")

MAX_TOOLS = 1000
MAX_PAGES = 50
WINDOW = 10.0  # seconds of the unasked-message bound
UNSOLICITED_LIMIT = 200  # unasked messages handled per window; more are dropped
THREAD_PARSE = 64 * 1024  # messages this large or larger are parsed on a thread
MAX_REPLIES = 16  # answers to the server's own requests being written at once
LIST_CHANGED = "notifications/tools/list_changed"


class McpClient:
    def __init__(self, name: str, transport: Transport, *,
                 on_tools_changed: Callable[[], None] | None = None,
                 unsolicited_limit: int = UNSOLICITED_LIMIT) -> None:
        self.name = name
        self.transport = transport
        self.on_tools_changed = on_tools_changed
        self.unsolicited_limit = unsolicited_limit
        self.protocol_version: str | None = None
        self.server_info: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.instructions = ""
        self.tools: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._window_start = time.monotonic()
        self._window_count = 0
        self._replies: set[asyncio.Task[None]] = set()
        self._flooded = False
        self._watch: asyncio.Task[None] | None = None
        # What the server sent unasked, for the operator page.
        self.stats = {"unsolicited": 0, "dropped": 0, "garbage": 0, "oversize": 0,
                      "requests_refused": 0}

    # ------------------------------------------------------------------ lifecycle
    async def start(self, timeout: float) -> None:
        """Connect, initialize, list the tools; raises McpError (and closes) on failure."""
        try:
            async with asyncio.timeout(timeout):
                await self.transport.open(self)
                self._watch = asyncio.get_running_loop().create_task(
                    self._watch_closed(), name=f"mcp-watch {self.name}")
                init = await self._request("initialize", {
                    "protocolVersion": PROTOCOL_VERSIONS[0],
                    "capabilities": CLIENT_CAPABILITIES, "clientInfo": CLIENT_INFO})
                if not isinstance(init, dict):
                    raise ProtocolFailure("initialize: the answer is not an object")
                version = init.get("protocolVersion")
                if version not in PROTOCOL_VERSIONS:
                    raise ProtocolFailure(f"the server speaks protocol {version!r}; mdclaw "
                                          f"speaks {', '.join(PROTOCOL_VERSIONS)}")
                self.protocol_version = version
                setattr(self.transport, "protocol_version", version)  # noqa: B010 - HTTP
                caps = init.get("capabilities")
                self.capabilities = caps if isinstance(caps, dict) else {}
                info = init.get("serverInfo")
                self.server_info = info if isinstance(info, dict) else {}
                text = init.get("instructions")
                self.instructions = text[:2000] if isinstance(text, str) else ""
                await self.transport.send(notification("notifications/initialized"))
                listen = getattr(self.transport, "listen", None)
                if callable(listen):
                    listen()
                self.tools = await self._list_tools() if "tools" in self.capabilities else []
        except TimeoutError:
            await self.close()
            raise CallTimeout(f"{self.name} did not start within {timeout:g} s"
                              + self._tail()) from None
        except McpError as e:
            await self.close()
            raise type(e)(f"{e}{self._tail()}") from None

    def _tail(self) -> str:
        tail = self.transport.stderr_tail().strip()
        return f" (its stderr ends: {tail[-300:]!r})" if tail else ""

    async def _watch_closed(self) -> None:
        await self.transport.closed.wait()
        self._fail_all(ServerCrashed(f"{self.name}: {self.transport.reason}"))

    def _fail_all(self, error: McpError) -> None:
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(error)

    @property
    def is_up(self) -> bool:
        return not self.transport.closed.is_set()

    async def close(self) -> None:
        await self.transport.close()
        self._fail_all(ServerCrashed(f"{self.name}: {self.transport.reason or 'closed'}"))
        for t in list(self._replies):
            t.cancel()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch

    # ------------------------------------------------------------------ requests
    async def _request(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Send a request and wait for its answer (the caller bounds the time)."""
        mid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[mid] = fut
        try:
            await self.transport.send(request(mid, method, params), mid)
            return await fut
        except asyncio.CancelledError:
            # Timed out (or the call was cancelled): tell the server to stop, best effort.
            if self.is_up and method != "initialize":
                self._spawn(self.transport.send(notification(
                    "notifications/cancelled", {"requestId": mid, "reason": "timed out"})))
            raise
        finally:
            self._pending.pop(mid, None)

    async def _list_tools(self) -> list[dict[str, Any]]:
        tools: list[dict[str, Any]] = []
        cursor = None
        for _ in range(MAX_PAGES):
            page = await self._request("tools/list", {"cursor": cursor} if cursor else {})
            if not isinstance(page, dict) or not isinstance(page.get("tools"), list):
                raise ProtocolFailure("tools/list: the answer has no tool list")
            tools += [t for t in page["tools"] if isinstance(t, dict)]
            cursor = page.get("nextCursor")
            if not cursor or len(tools) >= MAX_TOOLS:
                break
        return tools[:MAX_TOOLS]

    async def refresh_tools(self, timeout: float) -> list[dict[str, Any]]:
        """List the tools again (after tools/list_changed)."""
        async with asyncio.timeout(timeout):
            self.tools = await self._list_tools()
        return self.tools

    async def call_tool(self, name: str, arguments: dict[str, Any],
                        timeout: float) -> dict[str, Any]:
        """The server's CallToolResult; raises McpError (CallTimeout, ServerCrashed,
        TooLarge, ProtocolFailure...)."""
        try:
            async with asyncio.timeout(timeout):
                result = await self._request("tools/call", {"name": name,
                                                            "arguments": arguments})
        except TimeoutError:
            raise CallTimeout(f"{self.name} did not answer {name} within {timeout:g} s; "
                              "the call was cancelled") from None
        if not isinstance(result, dict):
            raise ProtocolFailure(f"{self.name}: the answer to {name} is not an object")
        return result

    async def ping(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            await self._request("ping")

    # ------------------------------------------------------------------ what comes in
    async def on_line(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw) if len(raw) < THREAD_PARSE else \
                await asyncio.to_thread(json.loads, raw)
        except ValueError:
            # Garbage before a message on the same line (a server printing to stdout): the
            # message is still read.
            at = raw.find(b'{"jsonrpc"', 1)
            if at > 0:
                await self.on_line(raw[at:])
                return
            self.stats["garbage"] += 1
            self._unsolicited("a line that is not JSON")
            return
        for m in (msg[:100] if isinstance(msg, list) else [msg]):
            self._dispatch(m)

    def on_oversize(self, over: Oversize, request_id: int | None) -> None:
        self.stats["oversize"] += 1
        rid = request_id if request_id is not None else over.request_id()
        error = TooLarge(f"{self.name} sent a message of {over.size} bytes, over its "
                         "max_result_bytes; it was dropped unread")
        if rid is not None:
            fut = self._pending.get(rid) if isinstance(rid, int) else None
            if fut is not None and not fut.done():
                fut.set_exception(error)
            else:
                self._unsolicited("an oversized message")
            return
        # Which call it answered cannot be told: every call in flight fails (each would
        # otherwise wait for an answer that was dropped).
        self._fail_all(error)

    def _dispatch(self, msg: Any) -> None:
        what = kind(msg)
        if what == "response":
            mid = msg.get("id")
            fut = self._pending.get(mid) if isinstance(mid, int) else None
            if fut is None or fut.done():
                self._unsolicited("an answer to no request")
                return
            if "error" in msg:
                fut.set_exception(ProtocolFailure(f"{self.name}: {error_text(msg['error'])}"))
            else:
                fut.set_result(msg.get("result"))
            return
        if not self._unsolicited(what):
            # Past the bound only a change of the tool list is still noted (it just sets a
            # flag; the list is read again once).
            if what == "notification" and msg["method"] == LIST_CHANGED \
                    and self.on_tools_changed:
                self.on_tools_changed()
            return
        if what == "request":
            if msg["method"] == "ping":
                self._reply(response(msg["id"], {}))
            else:
                self.stats["requests_refused"] += 1
                self._reply(error_response(
                    msg["id"], METHOD_NOT_FOUND, f"mdclaw does not offer {msg['method']}"))
        elif what == "notification":
            if msg["method"] == LIST_CHANGED and self.on_tools_changed:
                self.on_tools_changed()
        else:
            self.stats["garbage"] += 1

    def _unsolicited(self, what: str) -> bool:
        """Count one unasked message; False when it is over the window's bound (dropped).
        Far over it, the connection is closed."""
        self.stats["unsolicited"] += 1
        now = time.monotonic()
        if now - self._window_start > WINDOW:
            self._window_start, self._window_count = now, 0
        self._window_count += 1
        if self._window_count <= self.unsolicited_limit:
            return True
        self.stats["dropped"] += 1
        if self._window_count == self.unsolicited_limit + 1:
            log.warning("mcp: %s sends more than %d unasked messages in %g s (%s); the rest "
                        "are dropped", self.name, self.unsolicited_limit, WINDOW, what)
        if self._window_count > 10 * self.unsolicited_limit and self.is_up \
                and not self._flooded:
            self._flooded = True
            log.warning("mcp: %s floods unasked messages; disconnecting it", self.name)
            # The calls in flight fail with the reason now, before the server's own answer
            # to its connection closing could reach them.
            self._fail_all(ProtocolFailure(
                f"{self.name} sent more than {10 * self.unsolicited_limit} unasked messages "
                f"in {WINDOW:g} s; it was disconnected (and is started again)"))
            self._spawn(self.transport.close())
        return False

    def _reply(self, msg: dict[str, Any]) -> None:
        if len(self._replies) >= MAX_REPLIES:
            self.stats["dropped"] += 1
            return
        self._spawn(self.transport.send(msg))

    def _spawn(self, coro: Any) -> None:
        async def quietly() -> None:
            with contextlib.suppress(McpError, OSError):
                async with asyncio.timeout(5):
                    await coro
        task = asyncio.get_running_loop().create_task(quietly())
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)
