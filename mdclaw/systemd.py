"""systemd notify protocol: READY, STATUS, RELOADING, STOPPING and the watchdog.

Messages go through the `sdnotify` library to $NOTIFY_SOCKET (a no-op when systemd did not
start us). The watchdog is pinged from the event loop itself, and only while every registered
liveness probe has made progress recently, so a wedged IPC loop or scheduler stops the pings
and systemd restarts the service.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import sdnotify

log = logging.getLogger("mdclaw.systemd")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WATCHDOG_USEC), or None when not enabled."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2_000_000 if value > 0 else None


class Notifier:
    def __init__(self) -> None:
        self._n = sdnotify.SystemdNotifier()
        self._probes: dict[str, Callable[[], float]] = {}

    def send(self, *lines: str) -> None:
        self._n.notify("\n".join(lines))

    def ready(self, status: str | None = None) -> None:
        self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd >= 253 match the reload to this notification.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def add_probe(self, name: str, last_progress: Callable[[], float]) -> None:
        """Register a function returning the time.monotonic() of a component's last tick."""
        self._probes[name] = last_progress

    def stale_probes(self, max_age: float) -> list[str]:
        now = time.monotonic()
        return [n for n, f in self._probes.items() if now - f() > max_age]

    async def watchdog_loop(self, interval: float | None = None) -> None:
        """Ping WATCHDOG=1 every `interval` seconds while all probes are fresh."""
        interval = interval or watchdog_interval()
        if not interval:
            return
        while True:
            stale = self.stale_probes(max_age=interval * 2)
            if stale:
                log.warning("withholding watchdog ping: no progress from %s", ", ".join(stale))
            else:
                self.send("WATCHDOG=1")
            await asyncio.sleep(interval)
