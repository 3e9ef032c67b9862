"""A group's model-proxy socket: the caps on what one container may do with it.

The host accepts on each group's unix socket itself instead of through aiohttp's site, so a
connection beyond the group's cap (`limits.proxy_connections`) is closed the moment it is
accepted (with a short 503 saying why): it never gets a transport, a task or a buffer, and the
daemon's descriptors stay bounded whatever the container attempts. Requests are counted in a
token bucket (`limits.proxy_requests_per_minute`), which the proxy's handler asks before it
forwards (mdclaw.proxy). Read deadlines for each connection come from mdclaw.listener.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import time

from aiohttp import web

from mdclaw.budget import DEFAULT_ANSWER_ESTIMATE
from mdclaw.listener import ConnectionGuard

log = logging.getLogger("mdclaw.proxy")

ACCEPT_BATCH = 64  # connections accepted per readiness event, before other work runs
ACCEPT_PAUSE = 1.0  # seconds not accepting after the process ran out of descriptors
CLOSE_GRACE = 0.05  # seconds a connection may finish what it does when its group stops
_BUSY_BODY = json.dumps({"type": "error", "error": {
    "type": "mdclaw_proxy_busy",
    "message": "too many open connections to mdclaw's model proxy from this group; close "
               "some and retry"}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                 b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
                 + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)



class GroupCaps:
    """One group's limits on its socket: open connections, and requests as a token bucket
    (`per_minute` tokens at most, refilled at `per_minute` a minute)."""

    def __init__(self, max_connections: int, per_minute: int,
                 tokens_per_day: int | None = None, timezone: str = "UTC",
                 answer_estimate: int = DEFAULT_ANSWER_ESTIMATE) -> None:
        self.max_connections = max_connections
        self.per_minute = per_minute
        self.tokens_per_day = tokens_per_day
        self.timezone = timezone
        self.answer_estimate = answer_estimate
        self.open = 0
        self.refused = 0  # connections closed at accept time
        self.limited = 0  # requests answered 429
        self.over_budget = 0  # requests refused for the daily token budget
        self.server_tools = 0  # requests refused for asking the API to run tools itself
        self._tokens = float(per_minute)
        self._at = time.monotonic()

    def take(self) -> float:
        """0 when a request may go now (and counts it), else the seconds until one may."""
        now = time.monotonic()
        rate = self.per_minute / 60.0
        self._tokens = min(float(self.per_minute), self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / rate


class CountedProtocol(asyncio.Protocol):
    """aiohttp's protocol for one connection, which gives its slot back when it ends."""

    def __init__(self, inner: asyncio.Protocol, caps: GroupCaps) -> None:
        self._inner = inner
        self._caps = caps
        self.made = False
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._caps.open -= 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        self._inner.connection_lost(exc)


class GroupListener:
    """Accepts on one group's socket itself (instead of aiohttp's site), so that a
    connection beyond the group's cap is closed the moment it is accepted: it never gets a
    transport, a task or a buffer, and the daemon holds at most `max_connections` + 1
    descriptors for the group however many connections the container attempts."""

    def __init__(self, folder: str, sock: socket.socket, server: web.Server,
                 caps: GroupCaps, guard: ConnectionGuard) -> None:
        self.folder = folder
        self.sock = sock
        self.server = server
        self.caps = caps
        self.guard = guard  # header, body and idle deadlines (mdclaw.listener)
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._paused: asyncio.TimerHandle | None = None
        self._closed = False
        self._warned = False

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: stop accepting for a moment (the kernel
                    # keeps the waiting connections) rather than spin.
                    log.error("group %s: proxy cannot accept: %s; pausing %.0f s",
                              self.folder, e.strerror, ACCEPT_PAUSE)
                    self._pause()
                    return
                raise
            if self.caps.open >= self.caps.max_connections:
                self._refuse(conn)
                continue
            self.caps.open += 1
            task = self._loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refuse(self, conn: socket.socket) -> None:
        self.caps.refused += 1
        if not self._warned:
            self._warned = True
            log.warning("group %s: more than %d connections to the model proxy; closing the "
                        "extra ones", self.folder, self.caps.max_connections)
        try:
            conn.setblocking(False)
            conn.send(BUSY_RESPONSE)  # best effort: the client learns why
        except OSError:
            pass
        conn.close()

    def _pause(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self._paused = self._loop.call_later(ACCEPT_PAUSE, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            self.start()

    async def _serve(self, conn: socket.socket) -> None:
        counted: CountedProtocol | None = None

        def factory() -> CountedProtocol:
            nonlocal counted
            counted = CountedProtocol(self.guard.protocol(self.server()), self.caps)
            return counted

        try:
            await self._loop.connect_accepted_socket(factory, sock=conn)
        except BaseException as e:  # noqa: BLE001 - any end of the set-up gives the slot back
            # Without a transport nobody else gives the slot back or closes the socket.
            if counted is None or not counted.made:
                if counted is not None:
                    counted.release()
                else:
                    self.caps.open -= 1
                conn.close()
            if not isinstance(e, Exception):
                raise  # cancelled, or the process is ending
            # A client gone before the set-up is an OSError; anything else is a bug: traceback.
            log.warning("group %s: proxy connection could not be set up: %r", self.folder, e,
                        exc_info=not isinstance(e, OSError))

    async def close(self) -> None:
        """Stop accepting and close the listening socket (open connections stay; the
        AppRunner's cleanup closes them)."""
        self._closed = True
        if self._paused is not None:
            self._paused.cancel()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
