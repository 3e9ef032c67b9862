"""The container runtimes' shared vocabulary: the interface every engine implements
(`ContainerRuntime`, `RunningContainer`), what the runner hands it (`RunSpec`, `Mount`), what it
answers (`ContainerInfo`, `ImageInfo`), its errors and the labels mdclaw puts on containers.

The engines (mdclaw.runtime.docker_engine, mdclaw.runtime.apple) import only this module;
mdclaw.runtime picks one of them (`create_runtime`) and re-exports these names.
"""

from __future__ import annotations

import builtins
import functools
import logging
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mdclaw.errors import EngineError

log = logging.getLogger("mdclaw.runtime")

LABEL = "mdclaw"  # every container mdclaw starts has mdclaw=true
INSTALL_LABEL = "mdclaw.install"  # ...and mdclaw.install=<install id>
GROUP_LABEL = "mdclaw.group"
BOOT_LABEL = "mdclaw.boot"  # which daemon process started it

STDOUT: Literal[1] = 1
STDERR: Literal[2] = 2
Stream = Literal[1, 2]

class EngineCallError(EngineError):
    """Base of the errors a runtime raises (a call to the container engine failed); the
    message is for a person."""


class EngineUnavailable(EngineCallError):
    """The engine's API cannot be reached (not installed, not started, wrong socket)."""


class ImageError(EngineCallError):
    """An image could not be built, loaded or found. Retrying a run does not help."""

    permanent = True


@functools.cache
def engine_errors() -> tuple[type[Exception], ...]:
    """What a ContainerRuntime call raises when the engine fails, for `except
    engine_errors():` around one: the runtimes' own EngineCallError (EngineUnavailable,
    ImageError...), the Docker SDK's errors that DockerRuntime passes on (an API answer other
    than "not connected"), and OSError / SubprocessError from the Apple CLI. Anything else
    is a bug."""
    # Imported here, on the first call (an engine call failed), for the CLI's start-up: the
    # Docker SDK takes ~0.2 s to import, and most commands never talk to the engine.
    import docker.errors

    return (EngineCallError, docker.errors.DockerException, OSError, subprocess.SubprocessError)


@dataclass(frozen=True)
class Mount:
    """A bind mount. `host` must be absolute; `container` is the absolute path inside."""

    host: str
    container: str
    readonly: bool = True


@dataclass
class RunSpec:
    """Everything needed to start one container. Mutable on purpose: the runner's spec hooks
    add mounts and environment variables before the container starts."""

    name: str
    image: str
    labels: dict[str, str]
    command: list[str] | None = None
    stdin: bytes = b""
    env: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    user: str | None = "1000:1000"
    group_add: list[str] = field(default_factory=list)
    network: str = "none"
    read_only: bool = True
    # The container's own /tmp (a tmpfs inside it), not the host's.
    tmpfs: dict[str, str] = field(
        default_factory=lambda: {"/tmp": "rw,nosuid,nodev,size=256m"})  # noqa: S108
    cap_drop: list[str] = field(default_factory=lambda: ["ALL"])
    security_opt: list[str] = field(default_factory=lambda: ["no-new-privileges"])
    memory: str | None = None  # docker syntax: "2g", "512m"
    cpus: float | None = None
    pids: int | None = None
    workdir: str | None = None
    init: bool = True  # a tiny init as PID 1: signals reach the agent, zombies are reaped


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    name: str
    state: str
    image: str
    labels: dict[str, str]
    created: str = ""

    def as_dict(self) -> dict[str, object]:
        return {"id": self.id[:12], "name": self.name, "state": self.state, "image": self.image,
                "group": self.labels.get(GROUP_LABEL, ""),
                "install": self.labels.get(INSTALL_LABEL, ""), "created": self.created}


BACKENDS_LABEL = "mdclaw.backends"  # image label: the agent backends built in ("openai,claude")


@dataclass(frozen=True)
class ImageInfo:
    ref: str
    id: str
    tags: tuple[str, ...]
    created: str
    size: int
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def backends(self) -> tuple[str, ...] | None:
        """The backends the image says it carries (label written at build time), or None
        for an image built without the label."""
        value = self.labels.get(BACKENDS_LABEL)
        if not value:  # no label, or built without MDCLAW_BACKENDS
            return None
        return tuple(b.strip() for b in value.split(",") if b.strip())


class RunningContainer(ABC):
    """A started container. `chunks()` must be consumed (from one thread) until it ends."""

    id: str
    name: str
    # Set by wait() when the engine says the kernel's OOM killer ended the container.
    oom_killed: bool = False

    @abstractmethod
    def chunks(self) -> Iterator[tuple[Stream, bytes]]:
        """Yield (STDOUT|STDERR, bytes) as the container writes; ends when it exits."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Block until the container has exited; return its exit status."""

    @abstractmethod
    def close(self) -> None:
        """Release the output stream (idempotent); unblocks a reader of chunks()."""


class ContainerRuntime(ABC):
    """What mdclaw needs from a container engine. All methods block; all raise
    EngineUnavailable when the engine cannot be reached."""

    engine: str
    description: str  # where it talks to, for status lines

    @abstractmethod
    def ping(self) -> str:
        """Return a one-line engine description (name and version); raise EngineUnavailable."""

    @abstractmethod
    def image_info(self, ref: str) -> ImageInfo | None:
        """The image `ref` if the engine has it, else None."""

    @abstractmethod
    def build_image(self, tag: str, dockerfile: Path, context: Path,
                    progress: Callable[[str], None] | None = None,
                    build_args: dict[str, str] | None = None) -> str:
        """Build `dockerfile` with `context` (and `build_args` for its ARGs), tag it, return
        the image id; raise ImageError."""

    @abstractmethod
    def load_image(self, tarball: Path,
                   progress: Callable[[str], None] | None = None) -> list[str]:
        """Load an image tarball (docker-archive/OCI, maybe gzipped); return loaded refs."""

    @abstractmethod
    def start(self, spec: RunSpec) -> RunningContainer:
        """Create, attach, start, write stdin; raise ImageError if the image is missing."""

    # True when the engine can create a container now and start it later (`create`, then
    # `start_created`): the runner then keeps a created container ready for a group's next
    # run. The Apple CLI cannot attach to a created container, so it says False.
    supports_create: bool = False

    def create(self, spec: RunSpec) -> str:
        """Create (not start) the container of `spec` and return its id; `spec.stdin` is not
        used yet. Raise ImageError if the image is missing."""
        raise NotImplementedError(f"{type(self).__name__} cannot create without starting")

    def start_created(self, container_id: str, spec: RunSpec) -> RunningContainer:
        """Attach to and start a container `create` made from a spec equal to `spec` (but
        for name and stdin), and write `spec.stdin`. On failure the container is removed."""
        raise NotImplementedError(f"{type(self).__name__} cannot start a created container")

    @abstractmethod
    def stop(self, container_id: str, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. A container already gone is fine."""

    @abstractmethod
    def kill(self, container_id: str) -> None:
        """SIGKILL now. A container already gone is fine."""

    @abstractmethod
    def remove(self, container_id: str) -> None:
        """Remove (force). A container already gone is fine."""

    @abstractmethod
    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        """Containers carrying every one of `labels` (running and, with all, stopped)."""

    def cleanup(self, labels: dict[str, str]) -> builtins.list[str]:
        """Remove every container carrying all of `labels`; return the names removed."""
        removed = []
        for info in self.list(labels, all=True):
            try:
                self.remove(info.id)
                removed.append(info.name)
            except EngineCallError as e:
                log.warning("could not remove container %s: %s", info.name, e)
        return removed
