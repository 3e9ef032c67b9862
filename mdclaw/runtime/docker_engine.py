"""`DockerRuntime`: the Docker Engine API through the `docker` SDK (dockerd or Podman).

A run attaches to the container's stdin/stdout/stderr with one hijacked connection before the
container starts, so no output can be missed; stdin is written by a short-lived thread (a
container that never reads stdin cannot block the caller) and then half-closed, which is the
container's end of input. Output frames are demultiplexed as they arrive.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions
from docker.types import Mount as DockerMount

from mdclaw.runtime.base import (
    STDERR,
    STDOUT,
    ContainerInfo,
    ContainerRuntime,
    EngineCallError,
    EngineUnavailable,
    ImageError,
    ImageInfo,
    RunningContainer,
    RunSpec,
    Stream,
)

log = logging.getLogger("mdclaw.runtime.docker")

API_TIMEOUT = 60  # seconds for ordinary API calls; a build or load gets longer


def _is_connection_error(e: BaseException) -> bool:
    if isinstance(e, requests.exceptions.ConnectionError | ConnectionError | FileNotFoundError):
        return True
    return isinstance(e, docker.errors.DockerException) and not isinstance(
        e, docker.errors.APIError | docker.errors.ImageNotFound | docker.errors.NotFound)


class DockerRuntime(ContainerRuntime):
    """One class for dockerd and Podman: both serve the Docker Engine API on a socket."""

    def __init__(self, base_url: str, engine: str = "docker") -> None:
        self.base_url = base_url
        self.engine = engine
        self.description = base_url
        self._client: docker.DockerClient | None = None
        self._lock = threading.Lock()
        # Attach streams of containers created and not yet started (see create).
        self._attached: dict[str, tuple[socket.socket, Any]] = {}

    # ----------------------------------------------------------------- plumbing

    def _api(self) -> docker.APIClient:
        with self._lock:
            if self._client is None:
                try:
                    self._client = docker.DockerClient(base_url=self.base_url,
                                                       timeout=API_TIMEOUT)
                except (docker.errors.DockerException, OSError, ValueError) as e:
                    # Every way of not connecting: the SDK wraps the requests errors in a
                    # DockerException; an address it cannot parse is a ValueError.
                    raise EngineUnavailable(_reason(e)) from None
            return self._client.api

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (docker.errors.DockerException, OSError) as e:  # the rest is not the engine's
            if _is_connection_error(e):
                with self._lock:
                    self._client = None  # reconnect (and re-negotiate) next time
                raise EngineUnavailable(_reason(e)) from None
            raise

    # ----------------------------------------------------------------- interface

    def ping(self) -> str:
        api = self._api()
        v = self._call(api.version)
        names = [c.get("Name", "") for c in v.get("Components") or []]
        name = next((n for n in names if n), "Docker Engine")
        return f"{name} {v.get('Version', '?')} (API {v.get('ApiVersion', '?')}) at {self.base_url}"

    def image_info(self, ref: str) -> ImageInfo | None:
        api = self._api()
        try:
            d = self._call(api.inspect_image, ref)
        except (docker.errors.ImageNotFound, docker.errors.NotFound):
            return None
        labels = (d.get("Config") or {}).get("Labels") or d.get("Labels") or {}
        return ImageInfo(ref=ref, id=d.get("Id", ""), tags=tuple(d.get("RepoTags") or ()),
                         created=str(d.get("Created", "")), size=int(d.get("Size") or 0),
                         labels={str(k): str(v) for k, v in labels.items()})

    def build_image(self, tag: str, dockerfile: Path, context: Path,
                    progress: Callable[[str], None] | None = None,
                    build_args: dict[str, str] | None = None) -> str:
        context = context.resolve()
        dockerfile = dockerfile.resolve()
        try:
            rel = dockerfile.relative_to(context)
        except ValueError:
            raise ImageError(f"{dockerfile} is not inside the build context {context}") from None
        if not dockerfile.is_file():
            raise ImageError(f"no Dockerfile at {dockerfile}")
        api = self._api()
        image_id = ""
        try:
            stream = self._call(api.build, path=str(context), dockerfile=str(rel), tag=tag,
                                rm=True, forcerm=True, decode=True, pull=False,
                                timeout=3600, buildargs=dict(build_args or {}))
            for item in stream:
                if "error" in item:
                    detail = item.get("errorDetail", {}).get("message") or item["error"]
                    raise ImageError(f"build of {tag} failed: {str(detail).strip()}")
                text = item.get("stream") or item.get("status")
                if text and progress:
                    for line in str(text).splitlines():
                        if line.strip():
                            progress(line.rstrip())
                aux = item.get("aux")
                if isinstance(aux, dict) and aux.get("ID"):
                    image_id = aux["ID"]
        except docker.errors.APIError as e:
            raise ImageError(f"build of {tag} failed: {e.explanation or e}") from None
        info = self.image_info(tag)
        if info is None:
            raise ImageError(f"build of {tag} finished but the engine has no image {tag}")
        return info.id or image_id

    def load_image(self, tarball: Path,
                   progress: Callable[[str], None] | None = None) -> list[str]:
        api = self._api()
        refs: list[str] = []
        try:
            with open(tarball, "rb") as f:
                result = self._call(api.load_image, f)
                items = [result] if isinstance(result, dict) else result
                for item in items:
                    if "error" in item:
                        raise ImageError(f"loading {tarball} failed: {item['error']}")
                    text = str(item.get("stream") or item.get("status") or "")
                    for line in text.splitlines():
                        line = line.strip()
                        if not line:
                            continue
                        if progress:
                            progress(line)
                        for prefix in ("Loaded image:", "Loaded image ID:", "Loaded image(s):"):
                            if line.startswith(prefix):
                                refs.extend(r.strip() for r in line[len(prefix):].split(","))
        except OSError as e:
            raise ImageError(f"cannot read {tarball}: {e.strerror or e}") from None
        except docker.errors.APIError as e:
            raise ImageError(f"loading {tarball} failed: {e.explanation or e}") from None
        return [r for r in refs if r]

    def start(self, spec: RunSpec) -> RunningContainer:
        return self.start_created(self.create(spec), spec)

    supports_create = True

    def create(self, spec: RunSpec) -> str:
        api = self._api()
        host_config = api.create_host_config(
            mounts=[DockerMount(target=m.container, source=m.host, type="bind",
                                read_only=m.readonly) for m in spec.mounts],
            network_mode=spec.network,
            read_only=spec.read_only,
            tmpfs=dict(spec.tmpfs),
            cap_drop=list(spec.cap_drop),
            security_opt=list(spec.security_opt),
            group_add=list(spec.group_add) or None,
            mem_limit=spec.memory,
            nano_cpus=int(spec.cpus * 1e9) if spec.cpus else None,
            pids_limit=spec.pids,
            init=spec.init or None,
        )
        # command None means the image's own command: docker-py takes it, its stubs do not.
        config = api.create_container_config(
            spec.image, spec.command,  # type: ignore[arg-type]
            user=spec.user, stdin_open=True, tty=False,
            environment=dict(spec.env), labels=dict(spec.labels), working_dir=spec.workdir,
            host_config=host_config, network_disabled=spec.network == "none",
        )
        config["StdinOnce"] = True  # half-closing our stdin closes the container's
        config["AttachStdin"] = config["AttachStdout"] = config["AttachStderr"] = True
        try:
            created = self._call(api.create_container_from_config, config, spec.name)
        except docker.errors.ImageNotFound:
            raise ImageError(f"image {spec.image} not found: build it with `mdclaw image build` "
                             "or load it with `mdclaw image load`") from None
        except docker.errors.APIError as e:
            if e.status_code == 404:
                raise ImageError(f"image {spec.image} not found: {e.explanation}") from None
            raise EngineCallError(f"cannot create container {spec.name}: "
                                f"{e.explanation or e}") from None
        cid = str(created["Id"])
        # Attach now: on Podman the attach takes longer than the start itself (100-400 ms
        # against 20-70 ms measured), so a container created ahead of its run is attached
        # ahead too. The stream is kept until start_created or remove.
        try:
            attached = self._attach(api, cid)
        except Exception as e:  # whatever stopped the attach: no container is left behind
            self._quiet(api.remove_container, cid, force=True)
            if isinstance(e, docker.errors.APIError):
                raise EngineCallError(f"cannot attach to container {spec.name}: "
                                    f"{e.explanation or e}") from None
            raise
        with self._lock:
            self._attached[cid] = attached
        return cid

    def _attach(self, api: Any, cid: str) -> tuple[socket.socket, Any]:
        """One hijacked stream to the container's stdin, stdout and stderr: (socket, the
        SDK's object that owns it)."""
        sock_io = self._call(api.attach_socket, cid,
                             params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock: socket.socket = getattr(sock_io, "_sock", sock_io)
        sock.settimeout(None)
        return sock, sock_io

    @staticmethod
    def _close_attached(kept: tuple[socket.socket, Any]) -> None:
        for closing in (kept[0].close, kept[1].close):
            try:
                closing()
            except OSError:
                pass

    def _detach(self, container_id: str) -> None:
        """Close the attach stream `create` kept for a container never started."""
        with self._lock:
            kept = self._attached.pop(container_id, None)
        if kept is not None:
            self._close_attached(kept)

    def start_created(self, container_id: str, spec: RunSpec) -> RunningContainer:
        api = self._api()
        cid = container_id
        with self._lock:
            kept = self._attached.pop(cid, None)
        try:
            if kept is None:
                kept = self._attach(api, cid)
            sock, sock_io = kept
            self._call(api.start, cid)
        except Exception as e:  # whatever stopped the start: no container is left behind
            if kept is not None:
                self._close_attached(kept)
            self._quiet(api.remove_container, cid, force=True)
            if isinstance(e, docker.errors.APIError):
                raise EngineCallError(f"cannot start container {spec.name}: "
                                    f"{e.explanation or e}") from None
            raise
        return _DockerRun(self, cid, spec.name, sock, sock_io, spec.stdin)

    def stop(self, container_id: str, grace: float = 2.0) -> None:
        api = self._api()
        self._quiet(api.stop, container_id, timeout=max(0, int(round(grace))))

    def kill(self, container_id: str) -> None:
        api = self._api()
        self._detach(container_id)
        self._quiet(api.kill, container_id)

    def remove(self, container_id: str) -> None:
        api = self._api()
        self._detach(container_id)
        self._quiet(api.remove_container, container_id, force=True)

    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        api = self._api()
        rows = self._call(api.containers, all=all,
                          filters={"label": [f"{k}={v}" for k, v in labels.items()]})
        out = []
        for r in rows:
            row_labels = r.get("Labels") or {}
            # Filter again here: engines differ in how they match several label filters.
            if any(row_labels.get(k) != v for k, v in labels.items()):
                continue
            names = r.get("Names") or [""]
            out.append(ContainerInfo(
                id=r.get("Id", ""), name=str(names[0]).lstrip("/"), state=r.get("State", ""),
                image=r.get("Image", ""), labels=dict(row_labels),
                created=str(r.get("Created", ""))))
        return out

    def inspect(self, container_id: str) -> dict[str, Any]:
        """The engine's raw inspect document (tests and `containers list` use it)."""
        api = self._api()
        return self._call(api.inspect_container, container_id)

    # ----------------------------------------------------------------- helpers

    def _quiet(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Call fn, treating "no such container" and "not running" as done."""
        try:
            self._call(fn, *args, **kwargs)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if e.status_code in (304, 404, 409):
                return
            raise EngineCallError(str(e.explanation or e)) from None


class _DockerRun(RunningContainer):
    def __init__(self, rt: DockerRuntime, cid: str, name: str, sock: socket.socket,
                 sock_io: Any, stdin: bytes) -> None:
        self.rt = rt
        self.id = cid
        self.name = name
        self._sock = sock
        self._sock_io = sock_io
        self._closed = False
        self._writer = threading.Thread(target=self._write_stdin, args=(stdin,),
                                        name=f"stdin-{name}", daemon=True)
        self._writer.start()

    def _write_stdin(self, data: bytes) -> None:
        try:
            if data:
                self._sock.sendall(data)
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as e:  # the container exited without reading all of it
            log.debug("stdin of %s not fully written: %s", self.name, e)

    def chunks(self) -> Iterator[tuple[Stream, bytes]]:
        """Demultiplex the attach stream: 8-byte headers (stream, 0, 0, 0, big-endian size)."""
        buf = bytearray()
        stream: Stream = STDOUT
        remaining = 0  # payload bytes still to come for the current frame
        while True:
            try:
                data = self._sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            buf += data
            while buf:
                if remaining:
                    take = min(remaining, len(buf))
                    chunk = bytes(buf[:take])
                    del buf[:take]
                    remaining -= take
                    yield stream, chunk
                    continue
                if len(buf) < 8:
                    break
                kind, size = buf[0], struct.unpack(">I", bytes(buf[4:8]))[0]
                del buf[:8]
                stream = STDERR if kind == 2 else STDOUT
                remaining = size

    def wait(self, timeout: float | None = None) -> int:
        # Polling inspect is several times quicker than the wait endpoint once the output
        # stream has ended (Podman's wait answered in 200-1000 ms, inspect in 20-40 ms), and
        # the stream ending means the process has exited: the loop is short.
        api = self.rt._api()
        deadline = time.monotonic() + (timeout or API_TIMEOUT)
        delay = 0.005
        try:
            while True:
                try:
                    state = self.rt._call(api.inspect_container, self.id).get("State") or {}
                except docker.errors.APIError as e:
                    # An inspect while the process is going away can fail on the engine's
                    # side (Podman: 500 "read /proc/N/cgroup: no such process"); it answers
                    # once the container has exited, so ask again.
                    if isinstance(e, docker.errors.NotFound) or not e.is_server_error():
                        raise
                    log.debug("inspect of exiting container %s failed (%s); asking again",
                              self.name, e.explanation or e)
                    state = {"Running": True}
                status = str(state.get("Status", "")).lower()
                if not state.get("Running") and status not in ("running", "created",
                                                               "configured", "restarting"):
                    self.oom_killed = bool(state.get("OOMKilled"))
                    return int(state.get("ExitCode", -1))
                if time.monotonic() > deadline:
                    break
                # A poll, not a retry (so not mdclaw.retry's Backoff): nothing failed, the
                # container is expected to reach "exited" within milliseconds, and the
                # interval only grows to spare the engine if it takes longer; the deadline,
                # then the wait endpoint, bound it. Jitter would only add latency.
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
            res = self.rt._call(api.wait, self.id, timeout=timeout or API_TIMEOUT)
        except docker.errors.NotFound:
            return -1
        except docker.errors.APIError as e:  # the runner reports EngineCallError as the error
            raise EngineCallError(str(e.explanation or e)) from None
        return int(res.get("StatusCode", -1))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self._sock_io.close()
        except OSError:  # already closed
            pass


def _reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if "FileNotFoundError" in text or "No such file" in text:
        return "no socket there (is the engine running?)"
    if "Connection refused" in text:
        return "connection refused (is the engine running?)"
    if "Permission denied" in text:
        return f"permission denied (is user {os.getuid()} in the engine's group?)"
    return text.splitlines()[0][:300]
