"""Slow and greedy clients against the daemon's listeners (mdclaw.listener), over real loopback
sockets: headers a byte at a time, a body that trickles, a connection that says nothing, a
client that never reads its answer, and too many connections from one address. Each is
closed by the server within its limit while a normal client is still served, and the
server's count of connections comes back to zero."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from mdclaw.listener import ConnectionGuard, ConnectionLimits
from mdclaw.webserver import WebServer

# aiohttp (3.14) also closes a connection that has not sent a whole request within its
# keep-alive timeout (idle_timeout + 1 s) of being made: idle_timeout is the longer one.
FAST = ConnectionLimits(header_timeout=1.0, body_timeout=1.0, body_min_rate=1024,
                        idle_timeout=2.0, max_per_client=64)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _echo_length(request: web.Request) -> web.Response:
    return web.json_response({"read": len(await request.read())})


def _served(limits: ConnectionLimits,
            routes: tuple[tuple[str, str, Callable[..., Awaitable[web.StreamResponse]]], ...] = ()
            ) -> WebServer:
    server = WebServer("127.0.0.1:0", limits=limits)
    server.add_route("GET", "/health", _health)
    server.add_route("POST", "/echo", _echo_length)
    for method, path, handler in routes:
        server.add_route(method, path, handler)
    return server


async def _connect(port: int, source: str = "127.0.0.1"
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """What the server sent until it closed the connection (an abort reads as a reset)."""
    got = b""
    try:
        while chunk := await reader.read(65536):
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return got


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await asyncio.sleep(0.02)


def test_slow_headers_are_closed_while_normal_clients_are_served() -> None:
    """100 connections sending a request's head a byte every 0.2 s, from 10 addresses (10
    each, under the cap): all closed about header_timeout after their first byte; meanwhile
    a normal client gets its answers; the server's connections come back to 0."""
    async def main() -> None:
        server = _served(FAST)
        await server.start()
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
        try:
            conns = [await _connect(server.port, f"127.0.0.{2 + i % 10}") for i in range(100)]
            t0 = time.monotonic()
            stop = asyncio.Event()

            async def trickle(w: asyncio.StreamWriter) -> None:
                for byte in head:
                    if stop.is_set() or w.is_closing():
                        return
                    try:
                        w.write(bytes([byte]))
                        await w.drain()
                    except (ConnectionResetError, BrokenPipeError):
                        return
                    await asyncio.sleep(0.2)

            trickles = [asyncio.create_task(trickle(w)) for _, w in conns]
            closed = asyncio.gather(*(_closed_by_server(r) for r, _ in conns))
            await _until(lambda: server.connections.open >= 100, 5)
            async with aiohttp.ClientSession(server.url) as http:
                for _ in range(3):
                    async with http.get("/health") as r:
                        assert r.status == 200
            answers = await asyncio.wait_for(closed, 10)
            took = time.monotonic() - t0
            stop.set()
            await asyncio.gather(*trickles)
            assert answers == [b""] * 100  # no answer: the head never ended
            assert 0.9 < took < 4.0, took  # header_timeout (1 s) after the first byte
            assert server.connections.closed["header_timeout"] == 100, server.connections.closed
            await _until(lambda: server.connections.open == 0, 5)
            for _, w in conns:
                w.close()
        finally:
            await server.stop()

    asyncio.run(main())


def test_connections_over_the_cap_per_address_are_closed_at_once() -> None:
    async def main() -> None:
        server = _served(ConnectionLimits(header_timeout=30, body_timeout=30, idle_timeout=30,
                                          max_per_client=5))
        await server.start()
        try:
            held = [await _connect(server.port, "127.0.0.2") for _ in range(5)]
            await _until(lambda: server.connections.per_client("127.0.0.2") == 5, 5)
            t0 = time.monotonic()
            extra = [await _connect(server.port, "127.0.0.2") for _ in range(20)]
            answers = await asyncio.wait_for(
                asyncio.gather(*(_closed_by_server(r) for r, _ in extra)), 5)
            assert time.monotonic() - t0 < 2  # at once, not at a timeout
            for answer in answers:  # a short 503 when the client could still read it
                assert answer == b"" or answer.startswith(b"HTTP/1.1 503 ")
            assert any(a.startswith(b"HTTP/1.1 503 ") for a in answers)
            assert server.connections.closed["over_cap"] == 20
            assert server.connections.per_client("127.0.0.2") == 5
            # another address is served meanwhile, and so is the first once it holds fewer
            r, w = await _connect(server.port, "127.0.0.3")
            w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await _closed_by_server(r)).startswith(b"HTTP/1.1 200 ")
            held[0][1].close()
            await _until(lambda: server.connections.per_client("127.0.0.2") == 4, 5)
            r, w = await _connect(server.port, "127.0.0.2")
            w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await _closed_by_server(r)).startswith(b"HTTP/1.1 200 ")
            for _, w in held:
                w.close()
            await _until(lambda: server.connections.open == 0, 5)
        finally:
            await server.stop()

    asyncio.run(main())


class _FakeTransport(asyncio.Transport):
    def __init__(self, peer: tuple[object, ...]) -> None:
        super().__init__()
        self.peer = peer
        self.sent = b""
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.peer if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class _Inner(asyncio.Protocol):
    made = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Inner.made += 1


def test_ipv6_clients_are_counted_by_their_64() -> None:
    """One host holds a whole /64: changing its address does not get it more connections."""
    async def main() -> None:
        guard = ConnectionGuard(ConnectionLimits(max_per_client=2))
        first = [_FakeTransport(("2001:db8:1:2::1", 443, 0, 0)),
                 _FakeTransport(("2001:db8:1:2:ffff::9", 443, 0, 0))]
        for t in first:
            guard.protocol(_Inner()).connection_made(t)
        assert guard.per_client("2001:db8:1:2::77") == 2
        third = _FakeTransport(("2001:db8:1:2:abcd::1", 443, 0, 0))
        guard.protocol(_Inner()).connection_made(third)
        assert third.closed and third.sent.startswith(b"HTTP/1.1 503 ")
        other = _FakeTransport(("2001:db8:1:3::1", 443, 0, 0))  # the next /64: its own count
        guard.protocol(_Inner()).connection_made(other)
        assert not other.closed and _Inner.made == 3
        mapped = [_FakeTransport(("::ffff:192.0.2.7", 1, 0, 0)) for _ in range(3)]
        for t in mapped:  # an IPv4-mapped address counts as the IPv4 address
            guard.protocol(_Inner()).connection_made(t)
        assert guard.per_client("192.0.2.7") == 2 and mapped[2].closed

    asyncio.run(main())


def test_a_trickling_body_is_closed_and_a_steady_upload_is_not(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server = _served(FAST)
        await server.start()
        try:
            # 1 byte every 0.1 s of a 1,000-byte body: closed about body_timeout later
            r, w = await _connect(server.port)
            w.write(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n")
            stop = asyncio.Event()

            async def trickle() -> None:
                while not stop.is_set():
                    try:
                        w.write(b"x")
                        await w.drain()
                    except (ConnectionResetError, BrokenPipeError):
                        return
                    await asyncio.sleep(0.1)

            t0 = time.monotonic()
            task = asyncio.create_task(trickle())
            assert await asyncio.wait_for(_closed_by_server(r), 10) == b""
            took = time.monotonic() - t0
            stop.set()
            await task
            assert 0.9 < took < 3.0, took
            assert server.connections.closed["body_timeout"] == 1
            # one warning of the guard's, no traceback of the handler's interrupted read
            assert [r.levelname for r in caplog.records if r.levelno >= 30] == ["WARNING"]
            assert "request body came too slowly" in caplog.records[-1].getMessage()

            # 2.5 s of a steady 200 KiB/s upload (500 KiB): well over body_timeout, served
            async def steady():
                for _ in range(25):
                    yield b"y" * 20 * 1024
                    await asyncio.sleep(0.1)

            t0 = time.monotonic()
            async with aiohttp.ClientSession(server.url) as http:
                async with http.post("/echo", data=steady()) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["read"] == 25 * 20 * 1024
            assert time.monotonic() - t0 > 2.0
            assert server.connections.closed["body_timeout"] == 1
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_handler_that_reads_late_is_not_the_clients_fault() -> None:
    """The server stops reading a body its handler has not taken yet (flow control): that
    wait does not count against the client's body_timeout."""
    release = asyncio.Event()

    async def late(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"read": len(await request.content.read())})

    async def main() -> None:
        server = _served(FAST, (("POST", "/late", late),))
        await server.start()
        try:
            async with aiohttp.ClientSession(server.url) as http:
                async def later() -> None:
                    await asyncio.sleep(3 * FAST.body_timeout)
                    release.set()

                task = asyncio.create_task(later())
                async with http.post("/late", data=b"z" * (4 * 1024 * 1024)) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["read"] == 4 * 1024 * 1024
                await task
            assert server.connections.closed["body_timeout"] == 0
        finally:
            await server.stop()

    asyncio.run(main())


def test_silent_connections_and_clients_that_do_not_read_are_closed() -> None:
    big = b"w" * (16 * 1024 * 1024)

    async def large(request: web.Request) -> web.Response:
        return web.Response(body=big)

    async def main() -> None:
        server = _served(FAST, (("GET", "/large", large),))
        await server.start()
        try:
            # a connection that sends nothing: closed after idle_timeout
            r, w = await _connect(server.port)
            t0 = time.monotonic()
            assert await asyncio.wait_for(_closed_by_server(r), 10) == b""
            assert 1.9 < time.monotonic() - t0 < 4.0
            assert server.connections.closed["idle"] == 1
            w.close()

            # asks for 16 MiB and reads none of it: closed after idle_timeout
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            sock.send(b"GET /large HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await _until(lambda: server.connections.closed["not_reading"] == 1, 10)
            await _until(lambda: server.connections.open == 0, 5)
            sock.close()

            # a client that does read gets all of it
            async with aiohttp.ClientSession(server.url) as http:
                async with http.get("/large") as resp:
                    assert len(await resp.read()) == len(big)
        finally:
            await server.stop()

    asyncio.run(main())


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        ConnectionLimits(header_timeout=0)
    with pytest.raises(ValueError):
        ConnectionLimits(max_per_client=0)


def test_server_keys_reach_the_web_server(tmp_path: Path) -> None:
    from mdclaw.config import load_config
    from mdclaw.daemon.web import build_web_server, server_gate

    cfg = load_config(tmp_path / "c.yaml", text=(
        f"data_dir: {tmp_path}\nserver: {{listen: '127.0.0.1:0', header_timeout: 3s, "
        "body_timeout: 20s, idle_timeout: 2m, max_connections_per_client: 7}\n"))
    server = build_web_server(cfg, server_gate(cfg))
    assert server is not None
    assert server.connections.limits == ConnectionLimits(
        header_timeout=3, body_timeout=20, idle_timeout=120, max_per_client=7)
    default = build_web_server(load_config(tmp_path / "d.yaml", text=f"data_dir: {tmp_path}\n"),
                               server_gate(cfg))
    assert default is not None and default.connections.limits == ConnectionLimits()


def test_the_model_proxy_socket_closes_slow_clients(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's proxy socket: headers that trickle and a body that trickles are closed;
    a whole request right after is answered (404: not a model API path)."""
    from mdclaw import proxy as proxy_module
    from mdclaw.models import Upstream
    from mdclaw.paths import Layout

    monkeypatch.setattr(proxy_module, "ConnectionLimits", lambda **kw: ConnectionLimits(
        header_timeout=0.5, body_timeout=0.5, idle_timeout=2.0, **kw))

    async def main() -> None:
        proxy = proxy_module.CredentialProxy(Layout(tmp_path / "data"))
        path = await proxy.start_group("g1", Upstream("claude", "m", "http://127.0.0.1:9"))
        try:
            async def trickled(first: bytes, then: bytes) -> tuple[bytes, float]:
                r, w = await asyncio.open_unix_connection(str(path))
                w.write(first)
                t0 = time.monotonic()

                async def trickle() -> None:
                    for b in then:
                        try:
                            w.write(bytes([b]))
                            await w.drain()
                        except (ConnectionResetError, BrokenPipeError):
                            return
                        await asyncio.sleep(0.05)

                task = asyncio.create_task(trickle())
                got = await asyncio.wait_for(_closed_by_server(r), 10)
                took = time.monotonic() - t0
                task.cancel()
                w.close()
                return got, took

            got, took = await trickled(b"", b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n" * 20)
            assert got == b"" and 0.4 < took < 2.5
            got, took = await trickled(
                b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n",
                b"{" * 5000)
            assert got == b"" and 0.4 < took < 2.5
            r, w = await asyncio.open_unix_connection(str(path))
            w.write(b"GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await _closed_by_server(r)).startswith(b"HTTP/1.1 404 ")
            w.close()
        finally:
            await proxy.close()

    asyncio.run(main())
