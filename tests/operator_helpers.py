"""A real daemon (`python -m mdclaw run`) with the local HTTP channel, for the operator page's
tests: started in a subprocess without a container engine, waited for until it answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """`n` different free ports: all bound at once, so the kernel cannot hand one out twice
    (two free_port() calls in a row can return the same port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def running_daemon(config: Path, port: int, *,
                   ready: str | urllib.request.Request | None = None
                   ) -> Iterator[subprocess.Popen[str]]:
    """`mdclaw run --config config` until the block ends; up once /health answers (or,
    with `ready`, once that URL answers 200)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    env["DOCKER_HOST"] = "unix:///nonexistent/mdclaw-test-no-engine.sock"  # no engine
    log = config.parent / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config",
                                 str(config)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the daemon exited:\n{log.read_text()}")
            if ready is not None:
                with urllib.request.urlopen(ready, timeout=2) as r:
                    if r.status == 200:
                        return True
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return bool(json.load(r).get("connected"))

        try:
            wait_until(up, 60, interval=0.05, ignore=(OSError, urllib.error.URLError),
                       what="the daemon to answer")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{log.read_text()}") from None
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
