"""The credential proxy's per-group caps on real unix sockets: a connection flood from one
group neither exhausts the daemon's file descriptors nor stops other groups' answers, and a
request flood gets HTTP 429.

The proxy runs on its own event loop thread in this process (as in the daemon); the flood
comes from a separate process, so its own sockets do not count against this one's
descriptors, which are counted in /proc/self/fd.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from agent_helpers import ProxyThread
from fake_models import FakeAnthropic, say
from mdclaw.models import Upstream
from mdclaw.paths import Layout
from mdclaw.proxy_socket import BUSY_RESPONSE
from waiting import wait_until

FLOOD = textwrap.dedent("""\
    import errno, os, resource, socket, sys, threading, time
    path, attempts = sys.argv[1], int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()

    def attempt():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
            return s
        except BlockingIOError:    # the listen queue is full: the daemon is not taking more
            s.close()
            return "busy"
        except OSError as e:
            s.close()
            return e.errno

    # 1: `attempts` connections, every one the daemon took kept open, as an attacker would.
    held, busy, failed = [], 0, 0
    for _ in range(attempts):
        r = attempt()
        if isinstance(r, socket.socket):
            held.append(r)
        elif r == "busy":
            busy += 1
        else:
            failed += 1
    sys.stdout.write(f"{attempts} {len(held)} {busy} {failed}\\n")
    sys.stdout.flush()
    # 2: then keep connecting and dropping as fast as it can until told to stop.
    more = 0
    while not stop.is_set():
        r = attempt()
        more += 1
        if isinstance(r, socket.socket):
            r.close()
    sys.stdout.write(f"{more}\\n")
""")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


class FdSampler(threading.Thread):
    """The most descriptors this process had open, sampled every few milliseconds."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = fd_count()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, fd_count())


async def _get(sock: Path, path: str = "/not-an-api-path") -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
        async with s.get(f"http://localhost{path}") as r:
            return r.status, dict(r.headers), await r.json(content_type=None)


def get(sock: Path, path: str = "/not-an-api-path", timeout: float = 5.0):
    return asyncio.run(asyncio.wait_for(_get(sock, path), timeout))


def raw_response(sock: Path, timeout: float = 5.0) -> bytes:
    """Connect and read what the proxy says before anything is sent (b'' if nothing).
    While a flood fills the listen queue, connecting is retried until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(sock))
            break
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)
    with s:
        try:
            s.settimeout(0.5)
            return s.recv(4096)
        except TimeoutError:
            return b""


@pytest.fixture
def proxy(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    p = ProxyThread(layout)
    yield p
    p.close()


def start(proxy: ProxyThread, folder: str, url: str = "http://127.0.0.1:9", **caps) -> Path:
    return proxy.call(proxy.proxy.start_group(folder, Upstream("claude", "m", url), **caps))


def test_connection_flood_is_capped_and_other_groups_answer(proxy) -> None:
    cap = 16
    hostile = start(proxy, "hostile", max_connections=cap)
    with FakeAnthropic([say(f"answer {i}") for i in range(5)]) as up:
        calm = start(proxy, "calm", url=up.url)
        assert get(calm)[0] == 404  # warm: imports and the first connection are done
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        base = fd_count()
        assert base < 500, base
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # a small daemon limit
        sampler = FdSampler()
        sampler.start()
        t0 = time.monotonic()
        flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(hostile), "10000"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            line = flood.stdout.readline()  # 10,000 attempts made; it keeps on attacking
            first_phase = time.monotonic() - t0
            attempts, held, busy, failed = map(int, line.split())
            # Meanwhile the other group's model requests go through, one after another.
            latencies = []
            for i in range(5):
                t1 = time.monotonic()
                status, _h, body = asyncio.run(asyncio.wait_for(_post(calm, i), 10))
                latencies.append(time.monotonic() - t1)
                assert status == 200, body
            # The hostile group's slots are all taken: one more is told so and closed.
            assert raw_response(hostile).startswith(b"HTTP/1.1 503"), "no 503 at the cap"
            caps = proxy.proxy.caps("hostile")
        finally:
            flood.stdin.close()
            second = flood.stdout.readline()
            flood.wait(30)
            sampler.done.set()
            sampler.join()
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert attempts == 10000 and failed == 0, line
    assert caps["open"] <= cap, caps
    # Every connection the kernel handed over beyond the cap was closed at once (a listen
    # queue's worth may still be waiting in the kernel).
    assert caps["refused"] >= held - cap - 128, (caps, line)
    assert max(latencies) < 5, latencies
    # Bounded: the group's cap, a batch of accepts, the calm group's requests and upstream.
    assert sampler.peak - base <= cap + 40, (sampler.peak, base, caps, line)
    # Once the flood's connections are gone, the hostile group is served again.
    wait_until(lambda: not proxy.proxy.caps("hostile")["open"], 10,
               what="the flood's connections to close")
    assert get(hostile)[0] == 404
    print(f"\nflood: {attempts} attempts in {first_phase:.2f} s: {held} connected, {busy} "
          f"found the queue full; then {second.strip()} more while the calm group was served; "
          f"refused {caps['refused']}; fd peak +{sampler.peak - base} (cap {cap}); calm "
          f"latencies {[round(x, 3) for x in latencies]} s")


async def _post(sock: Path, i: int):
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
        async with s.post("http://localhost/v1/messages",
                          json={"model": "m", "max_tokens": 5,
                                "messages": [{"role": "user", "content": f"hi {i}"}]}) as r:
            return r.status, dict(r.headers), await r.read()


def test_connections_over_the_cap_are_closed_and_slots_come_back(proxy) -> None:
    sock = start(proxy, "g", max_connections=3)
    held = []
    for _ in range(3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(sock))
        held.append(s)
    wait_until(lambda: proxy.proxy.caps("g")["open"] == 3, 5, what="3 open connections")
    reply = raw_response(sock)
    assert reply == BUSY_RESPONSE
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["type"] == "mdclaw_proxy_busy"
    assert proxy.proxy.caps("g")["refused"] == 1
    held.pop().close()
    wait_until(lambda: proxy.proxy.caps("g")["open"] <= 2, 5, what="a slot to come back")
    assert get(sock)[0] == 404  # a slot is free again
    for s in held:
        s.close()


def test_requests_over_the_rate_get_429(proxy) -> None:
    busy = start(proxy, "busy", requests_per_minute=5)
    other = start(proxy, "other", requests_per_minute=5)

    async def burst(sock: Path, n: int) -> list[tuple[int, dict, dict]]:
        conn = aiohttp.UnixConnector(path=str(sock))
        out = []
        async with aiohttp.ClientSession(connector=conn) as s:
            for _ in range(n):
                async with s.get("http://localhost/v1/nothing") as r:
                    out.append((r.status, r.headers.copy(), await r.json(content_type=None)))
        return out

    replies = asyncio.run(burst(busy, 7))
    assert [r[0] for r in replies] == [404] * 5 + [429, 429]
    status, headers, body = replies[5]
    assert int(headers["retry-after"]) >= 1
    assert body["type"] == "error" and body["error"]["type"] == "mdclaw_proxy_rate_limited"
    assert "5 requests a minute" in body["error"]["message"]
    assert proxy.proxy.caps("busy")["limited"] == 2
    # Another group's bucket is its own.
    assert [r[0] for r in asyncio.run(burst(other, 2))] == [404, 404]


def test_caps_come_from_the_config(proxy, write_config) -> None:
    from mdclaw.config import load_config

    cfg = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true, proxy_requests_per_minute: 7}
          family: {name: F, jid: "hl:f"}
        limits: {proxy_connections: 5}
    """))
    proxy.call(proxy.proxy.start_for_config(cfg, "main"))
    proxy.call(proxy.proxy.start_for_config(cfg, "family"))
    main, family = proxy.proxy.caps("main"), proxy.proxy.caps("family")
    assert (main["max_connections"], main["requests_per_minute"]) == (5, 7)
    assert (family["max_connections"], family["requests_per_minute"]) == (5, 300)
