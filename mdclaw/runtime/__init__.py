"""Container runtimes: one small interface, one class per kind of engine.

`DockerRuntime` speaks the Docker Engine API through the `docker` SDK, so it serves dockerd and
Podman's Docker-compatible service alike; `AppleContainerRuntime` drives Apple's `container`
CLI. Everything here is blocking: the daemon calls it through `asyncio.to_thread` (or a thread
of its own for a running container's output).

The runner describes a container with a `RunSpec`; `start` creates it, attaches to its
streams, starts it and writes the spec's stdin, then returns a `RunningContainer` whose
`chunks()` yields the output as it arrives.

The interface and its types live in mdclaw.runtime.base (which the engines import); this
module re-exports them and adds finding the engine, the install's labels and waiting for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

from mdclaw import retry
from mdclaw.runtime.base import (
    BACKENDS_LABEL,
    BOOT_LABEL,
    GROUP_LABEL,
    INSTALL_LABEL,
    LABEL,
    STDERR,
    STDOUT,
    ContainerInfo,
    ContainerRuntime,
    EngineCallError,
    EngineUnavailable,
    ImageError,
    ImageInfo,
    Mount,
    RunningContainer,
    RunSpec,
    Stream,
    engine_errors,
)

if TYPE_CHECKING:
    from mdclaw.config import Config, Runtime

log = logging.getLogger("mdclaw.runtime")

# Where users expect the engine's API socket, in the order they expect it to win.
SOCKET_CANDIDATES = (
    "/run/docker.sock",
    "/var/run/docker.sock",
    "/run/podman/podman.sock",
)


# --------------------------------------------------------------------------- discovery


def install_id(cfg: Config) -> str:
    """The value of the install label: runtime.install_id, else a hash of data_dir (two
    installs on one host have different data dirs, so they never reap each other)."""
    if cfg.runtime.install_id:
        return cfg.runtime.install_id
    return hashlib.sha256(str(cfg.data_dir).encode()).hexdigest()[:12]


def install_labels(cfg: Config) -> dict[str, str]:
    return {LABEL: "true", INSTALL_LABEL: install_id(cfg)}


def find_socket(configured: str | None = None, env: dict[str, str] | None = None,
                exists: Callable[[str], bool] | None = None) -> str:
    """The engine API address as a URL (unix://..., tcp://...).

    Order: the configured socket, $DOCKER_HOST, /run/docker.sock, /var/run/docker.sock,
    /run/podman/podman.sock, $XDG_RUNTIME_DIR/podman/podman.sock. When none exists the
    first candidate is returned, so the error names where mdclaw looked first.
    """
    env = dict(os.environ) if env is None else env
    exists = exists or _is_socket
    if configured:
        return configured if "://" in configured else f"unix://{configured}"
    if env.get("DOCKER_HOST"):
        return env["DOCKER_HOST"]
    candidates = list(SOCKET_CANDIDATES)
    if env.get("XDG_RUNTIME_DIR"):
        candidates.append(os.path.join(env["XDG_RUNTIME_DIR"], "podman", "podman.sock"))
    for path in candidates:
        if exists(path):
            return f"unix://{path}"
    return f"unix://{candidates[0]}"


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def create_runtime(rt: Runtime) -> ContainerRuntime:
    """The runtime the config asks for (nothing is contacted yet)."""
    # The engines are imported here, for the CLI's start-up: docker_engine brings in the
    # Docker SDK (~0.2 s), which most commands never use.
    if rt.engine == "apple-container":
        from mdclaw.runtime.apple import AppleContainerRuntime

        return AppleContainerRuntime()
    from mdclaw.runtime.docker_engine import DockerRuntime

    return DockerRuntime(find_socket(rt.socket), engine=rt.engine)


async def wait_for_engine(runtime: ContainerRuntime, *,
                          status: Callable[[str], None] | None = None,
                          stop: asyncio.Event | None = None,
                          first_delay: float = 1.0, max_delay: float = 60.0) -> str | None:
    """Ping the engine until it answers, backing off (1 s doubling up to `max_delay`).

    Each failure is logged and passed to `status` as a sentence ("container engine
    unreachable at ...: ...; retrying in 8 s"), so a down engine shows in systemd's status
    instead of a crash loop. Returns the engine description, or None if `stop` was set first
    (at once: the wait between pings ends with it).
    """
    # No jitter: the pings go to a local engine socket that only this daemon waits on, and a
    # ping costs the engine next to nothing: there is no crowd to spread, and exact waits keep
    # the status line plain.
    backoff = retry.Backoff(base=first_delay, factor=2.0, cap=max_delay,
                           jitter=retry.NO_JITTER)
    attempt = 0
    while True:
        attempt += 1
        delay = backoff.delay(attempt)
        try:
            return await asyncio.to_thread(runtime.ping)
        except EngineUnavailable as e:
            line = (f"container engine unreachable at {runtime.description}: {e}; "
                    f"retrying in {delay:g} s (attempt {attempt})")
            log.warning("%s", line)
            if status:
                status(line)
        if await retry.wait(delay, stop):
            return None


__all__ = [
    "BACKENDS_LABEL", "BOOT_LABEL", "ContainerInfo", "ContainerRuntime", "EngineCallError",
    "EngineUnavailable", "GROUP_LABEL", "INSTALL_LABEL", "ImageError", "ImageInfo", "LABEL",
    "Mount", "RunSpec", "RunningContainer", "STDERR", "STDOUT", "Stream", "create_runtime",
    "engine_errors", "find_socket", "install_id", "install_labels", "wait_for_engine",
]
