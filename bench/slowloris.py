"""Slow clients against a real daemon's web server (`mdclaw run`, default `server:` limits).

`--clients N` raw sockets (500) connect to the daemon's port from `--addresses A` loopback
source addresses (127.0.0.2, 127.0.0.3, ...) and send a request head one byte a second
("slowloris"), for at most `--seconds` (40). Meanwhile a normal client asks for the chat page
(`GET /`) every half second. Measured: how many of the slow connections the daemon took and
how many it closed at once (over the per-address cap), when it closed the others (seconds
after their first byte), the page's latency and failures during the attack, and the
daemon's open descriptors (/proc/<pid>/fd) before, at the peak and after.

Prints one JSON object per figure. Usage: python bench/slowloris.py [--clients 500]
[--addresses 1] [--seconds 40] [--python PATH] [--root REPO]
(`--root` runs another checkout's mdclaw, e.g. main's, for a before/after comparison.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAD = (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slowloris\r\n"
        + b"".join(b"X-Slow-%d: %d\r\n" % (i, i) for i in range(200)))


def emit(name: str, **fields: object) -> None:
    print(json.dumps({"figure": name, **fields}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def start_daemon(python: str, root: Path, data: Path, port: int) -> subprocess.Popen[bytes]:
    cfg = data / "config.yaml"
    cfg.write_text(f"data_dir: {data / 'd'}\n"
                   "groups: {main: {name: Main, jid: 'hl:main', main: true}}\n"
                   f"server: {{listen: '127.0.0.1:{port}'}}\n"
                   "runtime: {socket: 'unix:///nonexistent/engine.sock'}\n")
    env = {**os.environ, "PYTHONPATH": str(root), "MDCLAW_CONFIG": str(cfg)}
    proc = subprocess.Popen([python, "-m", "mdclaw", "run"], env=env, cwd=root,
                            stdout=subprocess.DEVNULL, stderr=(data / "daemon.log").open("wb"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the daemon did not answer within 60 s; see " + str(data / "daemon.log"))


async def slow_client(port: int, source: str, t0: float, until: float,
                      out: list[tuple[str, float]]) -> None:
    """One slowloris connection: (how it ended, seconds after its first byte)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                       local_addr=(source, 0))
    except OSError:
        out.append(("refused_connect", time.monotonic() - t0))
        return
    first = time.monotonic()

    async def closed() -> str:
        try:
            data = await reader.read(65536)
        except (ConnectionResetError, BrokenPipeError):
            return "reset"
        return "answered_503" if data.startswith(b"HTTP/1.1 503") else (
            "answered" if data else "closed")

    ended = asyncio.ensure_future(closed())
    for byte in HEAD:
        if ended.done() or time.monotonic() >= until:
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except OSError:
            break
        try:
            await asyncio.wait_for(asyncio.shield(ended), 1.0)
        except TimeoutError:
            pass
    if ended.done():
        out.append((ended.result(), time.monotonic() - first))
    else:
        ended.cancel()
        out.append(("still_open", time.monotonic() - first))
    writer.close()


async def page_client(port: int, until: float, lat: list[float], failed: list[str]) -> None:
    loop = asyncio.get_running_loop()

    def get() -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            r.read()

    while time.monotonic() < until:
        t = time.monotonic()
        try:
            await loop.run_in_executor(None, get)
            lat.append((time.monotonic() - t) * 1000)
        except OSError as e:
            failed.append(repr(e))
        await asyncio.sleep(0.5)


async def attack(pid: int, port: int, clients: int, addresses: int, seconds: float) -> None:
    before = fds(pid)
    t0 = time.monotonic()
    until = t0 + seconds
    ends: list[tuple[str, float]] = []
    lat: list[float] = []
    failed: list[str] = []
    peak = before

    async def watch() -> None:
        nonlocal peak
        while time.monotonic() < until + 5:
            peak = max(peak, fds(pid))
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    page = asyncio.ensure_future(page_client(port, until, lat, failed))
    await asyncio.gather(*(slow_client(port, f"127.0.0.{2 + i % addresses}", t0, until, ends)
                           for i in range(clients)))
    await page
    watcher.cancel()
    await asyncio.sleep(1.0)
    after = fds(pid)
    kinds: dict[str, int] = {}
    for kind, _ in ends:
        kinds[kind] = kinds.get(kind, 0) + 1
    slow_closed = sorted(t for k, t in ends if k in ("closed", "reset") and t > 1.0)
    at_once = [t for k, t in ends if t <= 1.0 and k != "still_open"]
    emit("slowloris", clients=clients, addresses=addresses, seconds=seconds, outcomes=kinds,
         closed_at_once=len(at_once),
         closed_after_s=({"n": len(slow_closed), "min": round(slow_closed[0], 2),
                          "p50": round(statistics.median(slow_closed), 2),
                          "max": round(slow_closed[-1], 2)} if slow_closed else None),
         still_open_at_end=kinds.get("still_open", 0))
    emit("page_during_attack", requests=len(lat) + len(failed), failed=len(failed),
         p50_ms=round(statistics.median(lat), 1) if lat else None,
         max_ms=round(max(lat), 1) if lat else None, errors=failed[:3])
    emit("daemon_fds", before=before, peak=peak, after=after)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--addresses", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--root", type=Path, default=REPO)
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        proc = start_daemon(args.python, args.root.resolve(), Path(tmp), port)
        try:
            asyncio.run(attack(proc.pid, port, args.clients, args.addresses, args.seconds))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
