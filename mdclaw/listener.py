"""Listeners that hold against slow and greedy clients: the web server, the /metrics listener
and each group's model proxy socket serve HTTP through a `ConnectionGuard`.

aiohttp bounds the size of a request's head and body but not the time a client may take to
send them (it has no header or body read timeout), so a client that sends its headers a byte
a second ("slowloris") or its body as slowly ("R.U.D.Y.") would hold its connection, and a
descriptor of the daemon, for as long as it likes. The guard wraps aiohttp's protocol for
each connection (one `asyncio.Protocol` in front of another, nothing of aiohttp's inside
changed) and closes a connection:

- **at once**, when its client address already holds `max_per_client` connections (an IPv6
  client counted by its /64, like mdclaw.throttle counts wrong tokens), with a short 503;
- when a request's **headers** are not all there `header_timeout` seconds after its first
  byte (aiohttp calls the handler as soon as they are: the guard's middleware sees it);
- when a request's **body** is not all there `body_timeout` seconds after its headers, plus
  a second for every `body_min_rate` bytes that did arrive (a slow but steady upload goes on;
  time the server itself stopped reading, a handler that waits before it reads, is not held
  against the client);
- when a new connection sends nothing for `idle_timeout` seconds, or a client stops reading
  the answer for `idle_timeout` (the write side stays paused that long). Between requests
  on a kept-alive connection aiohttp's own `keepalive_timeout` (`idle_timeout` and a second,
  `ConnectionGuard.keepalive_timeout`) closes it.

A closed slow connection is aborted (its descriptor is free at once, nothing waits to be
flushed); each close is counted in `mdclaw_http_connections_closed` by listener and reason
and logged at most once a minute per reason. Handlers run as before: the guard never reads
or changes a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from mdclaw import metrics
from mdclaw.throttle import client_key

log = logging.getLogger("mdclaw.listener")

HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0
BODY_MIN_RATE = 1024  # bytes a second a body gets beyond its first body_timeout seconds
IDLE_TIMEOUT = 60.0
MAX_PER_CLIENT = 64
LOG_EVERY = 60.0  # seconds between two log lines of one reason

REASONS = ("over_cap", "header_timeout", "body_timeout", "idle", "not_reading")
_WORDS = {
    "over_cap": "over the cap of connections per client address",
    "header_timeout": "whose request headers were not all there in time",
    "body_timeout": "whose request body came too slowly",
    "idle": "that sent nothing",
    "not_reading": "that stopped reading the answer",
}
_BUSY_BODY = b"too many connections from this address; retry in a moment\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(_BUSY_BODY)).encode()
        + b"\r\n\r\n" + _BUSY_BODY)


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take, and how many connections it may hold (None: no cap,
    e.g. a unix socket only one container reaches)."""

    header_timeout: float = HEADER_TIMEOUT
    body_timeout: float = BODY_TIMEOUT
    body_min_rate: float = BODY_MIN_RATE
    idle_timeout: float = IDLE_TIMEOUT
    max_per_client: int | None = MAX_PER_CLIENT

    def __post_init__(self) -> None:
        if min(self.header_timeout, self.body_timeout, self.idle_timeout,
               self.body_min_rate) <= 0:
            raise ValueError("timeouts and the body's minimum rate must be positive")
        if self.max_per_client is not None and self.max_per_client < 1:
            raise ValueError("max_per_client must be at least 1")


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol `inner` behind the guard's deadlines."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.client: str | None = None
        self.refused = False
        # idle (no request under way) -> head (a request's first byte came) -> body (the
        # handler runs, its body still coming) -> busy (the handler runs) -> idle ...
        self.state = "idle"
        self.request: web.BaseRequest | None = None
        self.body_since = 0.0
        self.body_bytes = 0
        self._read_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None

    # ----------------------------------------------------------- the protocol's events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard.admit(self, transport):
            self.refused = True
            return
        self._arm(self.guard.limits.idle_timeout, "idle")
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if self.state == "idle":
            self.state = "head"
            self._arm(self.guard.limits.header_timeout, "header_timeout")
        elif self.state == "body":
            self.body_bytes += len(data)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def pause_writing(self) -> None:
        # The client does not read what it is sent: it has idle_timeout to start again.
        if self._send_timer is None:
            self._send_timer = self.guard.loop.call_later(
                self.guard.limits.idle_timeout, self._expire, "not_reading")
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        self.request = None
        if self.refused:
            return
        self.guard.release(self)
        self.inner.connection_lost(exc)

    # ----------------------------------------------------------- requests (middleware)
    def request_started(self, request: web.BaseRequest) -> None:
        """The request's headers are in (aiohttp called its handler)."""
        self._disarm()
        self.state = "busy"
        if request.body_exists and not request.content.is_eof():
            self.state = "body"
            self.request = request
            self.body_since = self.guard.loop.time()
            self.body_bytes = 0
            self._arm(self.guard.limits.body_timeout, "body_timeout")

    def request_ended(self) -> None:
        """The handler returned; between requests aiohttp's keep-alive timeout rules."""
        self._disarm()
        self.state = "idle"
        self.request = None

    # ----------------------------------------------------------- deadlines
    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._read_timer = self.guard.loop.call_later(seconds, self._expire, reason)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _expire(self, reason: str) -> None:
        if reason == "not_reading":
            self._send_timer = None
        else:
            self._read_timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        limits = self.guard.limits
        if reason != "not_reading" and not transport.is_reading():
            # The server stopped reading (its handler has not taken what came): the wait is
            # not the client's. Start the count again once it reads.
            self.body_since = self.guard.loop.time()
            self.body_bytes = 0
            self._arm(limits.body_timeout if reason == "body_timeout"
                      else limits.header_timeout, reason)
            return
        if reason == "body_timeout":
            request = self.request
            if self.state != "body" or request is None or request.content.is_eof():
                if self.state == "body":
                    self.state = "busy"
                self.request = None
                return
            due = self.body_since + limits.body_timeout + self.body_bytes / limits.body_min_rate
            left = due - self.guard.loop.time()
            if left > 0:
                self._arm(left, reason)
                return
        elif reason == "header_timeout" and self.state != "head":
            return
        elif reason == "idle" and self.state != "idle":
            return
        self.guard.closed_slow(self, reason)
        transport.abort()


class ConnectionGuard:
    """The deadlines and the per-client cap of one listener (`name` in logs and metrics).
    Serve with `site()` (TCP) or wrap each accepted connection's protocol with `protocol()`,
    and put `middleware` first in the application's middlewares."""

    def __init__(self, limits: ConnectionLimits | None = None, *, name: str = "web") -> None:
        self.limits = limits or ConnectionLimits()
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[asyncio.BaseTransport, _Guarded] = {}
        self._per_client: dict[str, int] = {}
        self.closed: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (logged at, count then)
        self._metric = {r: metrics.http_connections_closed.get(name, r) for r in REASONS}

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    @property
    def keepalive_timeout(self) -> float:
        """aiohttp's keep-alive timeout for the application runner: idle_timeout, and a
        second more so that on a new connection the guard's own idle deadline (counted and
        logged) comes first (aiohttp 3.14 also applies it from the connection's start)."""
        return self.limits.idle_timeout + 1.0

    @property
    def open(self) -> int:
        """Connections served now."""
        return len(self._conns)

    def per_client(self, address: str) -> int:
        """Connections served now from `address`'s client (its /64 for IPv6)."""
        return self._per_client.get(client_key(address), 0)

    def protocol(self, inner: asyncio.Protocol) -> asyncio.Protocol:
        """`inner` (aiohttp's protocol for one connection) behind this guard."""
        return _Guarded(self, inner)

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server`: `inner`'s protocols, guarded."""
        return lambda: _Guarded(self, inner())

    def site(self, runner: web.BaseRunner, host: str, port: int) -> GuardedSite:
        """A TCP site of `runner` (set up) whose connections pass this guard."""
        return GuardedSite(runner, host, port, self)

    # ----------------------------------------------------------- bookkeeping
    def admit(self, conn: _Guarded, transport: asyncio.Transport) -> bool:
        """Count `conn` in, or refuse it (a short 503, then closed) when its client is at
        the cap."""
        cap = self.limits.max_per_client
        if cap is not None:
            peer = transport.get_extra_info("peername")
            address = peer[0] if isinstance(peer, tuple) and peer else None
            conn.client = client_key(address if isinstance(address, str) else None)
            if self._per_client.get(conn.client, 0) >= cap:
                self._count("over_cap", conn.client)
                transport.write(BUSY)
                transport.close()
                return False
            self._per_client[conn.client] = self._per_client.get(conn.client, 0) + 1
        self._conns[transport] = conn
        return True

    def release(self, conn: _Guarded) -> None:
        if conn.transport is not None and self._conns.pop(conn.transport, None) is None:
            return
        if conn.client is not None:
            left = self._per_client.get(conn.client, 1) - 1
            if left > 0:
                self._per_client[conn.client] = left
            else:
                self._per_client.pop(conn.client, None)

    def closed_slow(self, conn: _Guarded, reason: str) -> None:
        self._count(reason, conn.client)

    def _count(self, reason: str, client: str | None) -> None:
        self.closed[reason] += 1
        self._metric[reason].inc()
        now = time.monotonic()
        at, before = self._logged.get(reason, (-LOG_EVERY, 0))
        if now - at >= LOG_EVERY:
            n = self.closed[reason] - before
            log.warning("%s: closed %d connection(s) %s (the latest from %s)", self.name, n,
                        _WORDS[reason], client or "a local socket")
            self._logged[reason] = (now, self.closed[reason])

    # ----------------------------------------------------------- requests
    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = self._conns.get(request.transport) if request.transport is not None else None
        if conn is None:  # not a connection of this guard's (a test client, ...)
            response: web.StreamResponse = await handler(request)
            return response
        conn.request_started(request)
        try:
            response = await handler(request)
            return response
        except ConnectionResetError:
            transport = conn.transport
            if transport is not None and not transport.is_closing():
                raise
            # The client is gone (closed here as too slow, or it hung up) while the handler
            # read its request: nobody is left to answer, and it is no error of the server's.
            return web.Response(status=408)
        finally:
            conn.request_ended()


class GuardedSite(web.BaseSite):
    """aiohttp's TCP site, with each connection's protocol behind `guard`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 guard: ConnectionGuard) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._guard = guard

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.factory(server), self._host, self._port, reuse_address=True)
        if self._server.sockets:
            self._port = int(self._server.sockets[0].getsockname()[1])
