"""How the host reaches an MCP server: a stdio process it starts, a unix socket speaking the
same framing (a stdio server run as a service of its own), or streamable HTTP.

Every transport hands the client whole messages as bytes, each at most `limit` bytes, and
reports a longer one as `Oversize` without reading it into memory (mdclaw.mcp.wire): the cap
holds before anything is parsed. A stdio server's stderr is drained all the time (a server
blocked on a full stderr pipe would hang) and only its last STDERR_TAIL bytes are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from mdclaw.mcp.wire import (
    LineFramer,
    Oversize,
    ProtocolFailure,
    ServerCrashed,
    ServerDown,
    encode,
)

log = logging.getLogger("mdclaw.mcp")

READ_CHUNK = 65536
STDERR_TAIL = 16 * 1024
STOP_GRACE = 2.0  # seconds a stdio server gets after its stdin closes, then after SIGTERM
SSE_EXTRA = 4096  # an SSE event's field names and separators, beyond the message itself


class Sink(Protocol):
    """The client side of a transport."""

    async def on_line(self, raw: bytes) -> None:
        """One message (JSON text) arrived."""

    def on_oversize(self, over: Oversize, request_id: int | None) -> None:
        """A message over the cap arrived and was dropped unread; `request_id`: the request
        it answered when the transport knows (HTTP), else None."""


class Transport(Protocol):
    describe: str

    async def open(self, sink: Sink) -> None:
        """Connect (or start the process); raises ServerDown when it cannot."""

    async def send(self, msg: dict[str, Any], request_id: int | None = None) -> None:
        """Send one message (a request's answer may arrive through the sink meanwhile)."""

    async def close(self) -> None:
        """Disconnect (stop the process); never raises."""

    @property
    def closed(self) -> asyncio.Event:
        """Set once the connection is gone; `reason` says why."""

    @property
    def reason(self) -> str:
        """Why the connection ended ("" while it is up)."""

    def stderr_tail(self) -> str:
        """The last bytes the server wrote to stderr (stdio only), as text."""


# --------------------------------------------------------------------------- streams


class _Writer(Protocol):
    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class _StreamTransport:
    """Newline-delimited JSON-RPC over a reader/writer pair (a pipe or a unix socket)."""

    describe = "stream"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._reader: asyncio.StreamReader | None = None
        self._writer: _Writer | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()
        self._reason = ""
        self._write_lock = asyncio.Lock()

    @property
    def closed(self) -> asyncio.Event:
        return self._closed

    @property
    def reason(self) -> str:
        return self._reason

    def stderr_tail(self) -> str:
        return ""

    def _start_reading(self, sink: Sink) -> None:
        self._task = asyncio.get_running_loop().create_task(self._read(sink),
                                                            name=f"mcp-read {self.describe}")

    async def _read(self, sink: Sink) -> None:
        assert self._reader is not None
        framer = LineFramer(self.limit)
        reason = "the server closed its output"
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    break
                for item in framer.feed(data):
                    if isinstance(item, Oversize):
                        sink.on_oversize(item, None)
                    else:
                        await sink.on_line(item)
        except (ConnectionError, OSError) as e:
            reason = f"reading from the server failed: {e}"
        except asyncio.CancelledError:
            reason = "closed by mdclaw"
            raise
        finally:
            await self._ended(reason)

    async def _ended(self, reason: str) -> None:
        if not self._reason:
            self._reason = reason
        self._closed.set()

    async def send(self, msg: dict[str, Any], request_id: int | None = None) -> None:
        if self._closed.is_set() or self._writer is None:
            raise ServerCrashed(f"the server is gone: {self._reason or 'not connected'}")
        async with self._write_lock:
            try:
                self._writer.write(encode(msg))
                await self._writer.drain()
            except (ConnectionError, OSError) as e:
                raise ServerCrashed(f"writing to the server failed: {e}") from None

    async def _close_stream(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        self._closed.set()


class StdioTransport(_StreamTransport):
    """A server the host starts as its own child process, in a process group of its own."""

    def __init__(self, command: str, args: list[str], env: dict[str, str], cwd: Path | None,
                 limit: int) -> None:
        super().__init__(limit)
        self.command, self.args, self.env, self.cwd = command, args, env, cwd
        self.describe = f"stdio {command}"
        self.proc: asyncio.subprocess.Process | None = None
        self._stderr: deque[bytes] = deque()
        self._stderr_size = 0
        self.stderr_bytes = 0  # all the server wrote to stderr
        self._stderr_task: asyncio.Task[None] | None = None

    async def open(self, sink: Sink) -> None:
        try:
            self.proc = await asyncio.create_subprocess_exec(
                self.command, *self.args, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=self.env, cwd=None if self.cwd is None else str(self.cwd),
                start_new_session=True)
        except OSError as e:
            where = f" in {self.cwd}" if self.cwd is not None else ""
            raise ServerDown(f"cannot start {self.command}{where}: {e.strerror or e}") from None
        self._reader, self._writer = self.proc.stdout, _PipeWriter(self.proc.stdin)
        self._stderr_task = asyncio.get_running_loop().create_task(
            self._drain_stderr(), name=f"mcp-stderr {self.command}")
        self._start_reading(sink)

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            while True:
                data = await self.proc.stderr.read(READ_CHUNK)
                if not data:
                    return
                self.stderr_bytes += len(data)
                self._stderr.append(data)
                self._stderr_size += len(data)
                while self._stderr_size - len(self._stderr[0]) >= STDERR_TAIL:
                    self._stderr_size -= len(self._stderr.popleft())

    def stderr_tail(self) -> str:
        data = b"".join(self._stderr)[-STDERR_TAIL:]
        return data.decode("utf-8", "replace")

    async def _ended(self, reason: str) -> None:
        # The output closed: say how the process ended, if it ended within a moment.
        if self.proc is not None and not self._reason and reason != "closed by mdclaw":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 1.0)
            code = self.proc.returncode
            if code is not None:
                reason = (f"the server exited with status {code}" if code >= 0 else
                          f"the server was killed by signal {-code}")
        await super()._ended(reason)

    async def close(self) -> None:
        proc = self.proc
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if proc is not None and proc.returncode is None:
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, sig)
                try:
                    await asyncio.wait_for(proc.wait(), STOP_GRACE)
                    break
                except TimeoutError:
                    continue
        if not self._reason:
            self._reason = "closed by mdclaw"
        await self._close_stream()
        if self._stderr_task is not None:
            self._stderr_task.cancel()
            with contextlib.suppress(BaseException):
                await self._stderr_task


class _PipeWriter:
    """A subprocess's stdin as the writer the stream transport expects."""

    def __init__(self, stdin: asyncio.StreamWriter | None) -> None:
        assert stdin is not None
        self.stdin = stdin

    def write(self, data: bytes) -> None:
        self.stdin.write(data)

    async def drain(self) -> None:
        await self.stdin.drain()

    def close(self) -> None:
        self.stdin.close()


class SocketTransport(_StreamTransport):
    """A unix socket whose other end is a stdio server (systemd's socket activation with
    Accept=yes hands each connection to a new instance of the server's service)."""

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(limit)
        self.path = path
        self.describe = f"socket {path}"

    async def open(self, sink: Sink) -> None:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(
                str(self.path), limit=READ_CHUNK * 2)
        except OSError as e:
            raise ServerDown(f"cannot connect to {self.path}: {e.strerror or e}") from None
        self._start_reading(sink)

    async def close(self) -> None:
        if not self._reason:
            self._reason = "closed by mdclaw"
        await self._close_stream()


# --------------------------------------------------------------------------- HTTP


class HttpTransport:
    """Streamable HTTP: each message is a POST; the answer comes as JSON or as a stream of
    server-sent events. Once initialized, a GET stream carries what the server sends unasked
    (when the server offers one)."""

    def __init__(self, url: str, headers: dict[str, str], limit: int,
                 connect_timeout: float = 10.0) -> None:
        self.url = url
        self.headers = headers
        self.limit = limit
        self.describe = f"http {url}"
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self._http: aiohttp.ClientSession | None = None
        self._sink: Sink | None = None
        self._closed = asyncio.Event()
        self._reason = ""
        self._listen: asyncio.Task[None] | None = None
        self.connect_timeout = connect_timeout

    @property
    def closed(self) -> asyncio.Event:
        return self._closed

    @property
    def reason(self) -> str:
        return self._reason

    def stderr_tail(self) -> str:
        return ""

    async def open(self, sink: Sink) -> None:
        self._sink = sink
        # Environment proxies are not used: the URL is the operator's, reached directly.
        self._http = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
            trust_env=False)

    def _headers(self, sse_only: bool = False) -> dict[str, str]:
        h = {"Accept": "text/event-stream" if sse_only else
             "application/json, text/event-stream", **self.headers}
        if not sse_only:
            h["Content-Type"] = "application/json"
        if self.session_id:
            h["Mcp-Session-Id"] = self.session_id
        if self.protocol_version:
            h["MCP-Protocol-Version"] = self.protocol_version
        return h

    def _gone(self, reason: str) -> None:
        if not self._reason:
            self._reason = reason
        self._closed.set()

    async def send(self, msg: dict[str, Any], request_id: int | None = None) -> None:
        if self._closed.is_set() or self._http is None or self._sink is None:
            raise ServerCrashed(f"the server is gone: {self._reason or 'not connected'}")
        try:
            async with self._http.post(self.url, data=encode(msg),
                                       headers=self._headers()) as r:
                if msg.get("method") == "initialize":
                    self.session_id = r.headers.get("Mcp-Session-Id") or None
                if r.status == 202 or (r.status == 200 and request_id is None
                                       and r.content_length == 0):
                    return
                if r.status == 404 and self.session_id:
                    self._gone("the server ended the session (HTTP 404)")
                    raise ServerCrashed("the server ended the session; it is reconnected")
                if r.status >= 400:
                    body = (await r.content.read(512)).decode("utf-8", "replace")
                    raise ProtocolFailure(f"the server answered HTTP {r.status}: "
                                          f"{' '.join(body.split())[:200]}")
                ctype = r.content_type
                if ctype == "application/json":
                    await self._read_json(r, request_id)
                elif ctype == "text/event-stream":
                    await self._read_sse(r, request_id)
                elif request_id is not None:
                    raise ProtocolFailure(f"the server answered with {ctype or 'no type'}, "
                                          "not JSON or an event stream")
        except aiohttp.ClientError as e:
            raise ServerDown(f"cannot reach {self.url}: {type(e).__name__}: {e}") from None

    async def _read_json(self, r: aiohttp.ClientResponse, request_id: int | None) -> None:
        assert self._sink is not None
        chunks: list[bytes] = []
        size = 0
        async for chunk in r.content.iter_chunked(READ_CHUNK):
            size += len(chunk)
            if size > self.limit:
                head = b"".join(chunks)[:4096] or chunk[:4096]
                async for more in r.content.iter_chunked(READ_CHUNK):  # counted, not kept
                    size += len(more)
                    if size > self.limit * 4:
                        break
                self._sink.on_oversize(Oversize(head, size), request_id)
                return
            chunks.append(chunk)
        body = b"".join(chunks).strip()
        if body:
            await self._sink.on_line(body)

    async def _read_sse(self, r: aiohttp.ClientResponse, request_id: int | None) -> None:
        """Dispatch each event's data; stop after the answer to `request_id`. A line or an
        event over the cap is skipped as it streams past and reported as oversized."""
        line_limit = self.limit + SSE_EXTRA
        buf = bytearray()
        skipping = False
        data: list[bytes] = []
        size = 0
        over = False
        event = b"message"
        async for chunk in r.content.iter_chunked(READ_CHUNK):
            pos = 0
            while True:
                nl = chunk.find(b"\n", pos)
                piece = chunk[pos:] if nl < 0 else chunk[pos:nl]
                if skipping:
                    size += len(piece)
                    line = None
                elif len(buf) + len(piece) > line_limit:
                    skipping, over = True, True
                    size += len(buf) + len(piece)
                    buf.clear()
                    line = None
                else:
                    buf += piece
                    line = None if nl < 0 else bytes(buf).rstrip(b"\r")
                if nl < 0:
                    break
                pos = nl + 1
                if line is None:  # the end of a skipped line
                    skipping = False
                    buf.clear()
                    continue
                buf.clear()
                if line == b"":
                    if data or over:
                        done = await self._event(event, data, over, size, request_id)
                        if done:
                            return
                    data, size, over, event = [], 0, False, b"message"
                elif line.startswith(b"data:"):
                    value = line[5:].removeprefix(b" ")
                    size += len(value)
                    if size > self.limit:
                        over = True
                        data = []
                    elif not over:
                        data.append(value)
                elif line.startswith(b"event:"):
                    event = line[6:].strip()
        if data or over:
            await self._event(event, data, over, size, request_id)

    async def _event(self, event: bytes, data: list[bytes], over: bool, size: int,
                     request_id: int | None) -> bool:
        """Hand one event to the sink; True when it answered `request_id`."""
        assert self._sink is not None
        if event != b"message":
            return False
        if over:
            self._sink.on_oversize(Oversize(b"", size), request_id)
            return request_id is not None
        body = b"\n".join(data).strip()
        if not body:
            return False
        await self._sink.on_line(body)
        if request_id is None:
            return False
        try:
            parsed = json.loads(body)
        except ValueError:
            return False
        return isinstance(parsed, dict) and parsed.get("id") == request_id \
            and "method" not in parsed

    def listen(self) -> None:
        """Open the GET stream for what the server sends unasked (once initialized)."""
        if self._listen is None and self._http is not None:
            self._listen = asyncio.get_running_loop().create_task(self._get_stream(),
                                                                  name="mcp-http-listen")

    async def _get_stream(self) -> None:
        assert self._http is not None
        try:
            async with self._http.get(self.url, headers=self._headers(sse_only=True)) as r:
                if r.status != 200 or r.content_type != "text/event-stream":
                    return  # the server offers none (405): list changes come with answers
                await self._read_sse(r, None)
        except (aiohttp.ClientError, OSError, ValueError) as e:
            log.debug("mcp: %s: the listening stream ended: %s", self.url, e)

    async def close(self) -> None:
        if self._listen is not None:
            self._listen.cancel()
            with contextlib.suppress(BaseException):
                await self._listen
        if self._http is not None:
            if self.session_id:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with asyncio.timeout(2):
                        async with self._http.delete(self.url, headers=self._headers()):
                            pass
            await self._http.close()
        self._gone("closed by mdclaw")


OpenTransport = Callable[[], Awaitable[Transport]]
