"""`AppleContainerRuntime`: Apple's `container` CLI on macOS.

The CLI resembles docker's, with two differences that matter here: bind mounts are written
`--mount type=bind,source=...,target=...[,readonly]` rather than `-v`, and `-e` is unreliable
together with `-i`, so environment variables go into a JSON file mounted read-only at
`/secrets.json` (the agent runner reads it when its stdin carries none). `container system
start` must have run before anything else; `ensure_system_started` does it once.

The translation from a RunSpec to arguments is pure (`run_args`, `translate_args`) and tested
on Linux; the rest shells out and is exercised only on a Mac.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

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

SECRETS_PATH = "/secrets.json"


def docker_style_args(spec: RunSpec) -> list[str]:
    """The `docker run` arguments (without `docker run` and the image) for `spec`."""
    args = ["-i", "--rm", "--name", spec.name]
    for k, v in spec.labels.items():
        args += ["--label", f"{k}={v}"]
    if spec.user:
        args += ["--user", spec.user]
    if spec.network:
        args += ["--network", spec.network]
    if spec.read_only:
        args.append("--read-only")
    for path, opts in spec.tmpfs.items():
        args += ["--tmpfs", f"{path}:{opts}" if opts else path]
    if spec.memory:
        args += ["--memory", spec.memory]
    if spec.cpus:
        args += ["--cpus", f"{spec.cpus:g}"]
    if spec.workdir:
        args += ["--workdir", spec.workdir]
    for m in spec.mounts:
        args += ["-v", f"{m.host}:{m.container}" + (":ro" if m.readonly else "")]
    for k, v in spec.env.items():
        args += ["-e", f"{k}={v}"]
    return args


def translate_args(args: list[str], secrets_dir: Path | None = None) -> tuple[list[str],
                                                                             dict[str, str]]:
    """Docker-style run arguments → Apple `container run` arguments.

    `-v HOST:CTR[:ro]` (also `--volume`) becomes `--mount type=bind,source=HOST,target=CTR
    [,readonly]`; every `-e K=V` (also `--env`) is collected and returned as a dict instead.
    When `secrets_dir` is given and there are variables, they are written there as
    `secrets.json` (mode 0600) and mounted read-only at /secrets.json. Options the CLI does not
    have (`--cap-drop`, `--security-opt`, `--pids-limit`, `--group-add`, `--tmpfs`,
    `--read-only`) are dropped: each container is its own lightweight VM there.
    """
    out: list[str] = []
    env: dict[str, str] = {}
    unsupported_with_value = {"--cap-drop", "--security-opt", "--pids-limit", "--group-add",
                              "--tmpfs"}
    unsupported_flags = {"--read-only", "--init"}
    i = 0
    while i < len(args):
        a = args[i]
        value: str | None = None
        if a in ("-v", "--volume", "-e", "--env") or a in unsupported_with_value:
            if i + 1 >= len(args):
                raise ValueError(f"{a} needs a value")
            value = args[i + 1]
            i += 2
        elif a.startswith(("--volume=", "--env=")) or a.split("=", 1)[0] in unsupported_with_value:
            a, value = a.split("=", 1)
            i += 1
        else:
            i += 1
        if a in ("-v", "--volume"):
            assert value is not None
            out += ["--mount", _bind(value)]
        elif a in ("-e", "--env"):
            assert value is not None
            key, sep, val = value.partition("=")
            if not key:
                raise ValueError(f"bad environment variable {value!r}")
            env[key] = val if sep else os.environ.get(key, "")
        elif a in unsupported_with_value or a in unsupported_flags:
            continue
        else:
            out.append(a)
    if env and secrets_dir is not None:
        path = Path(secrets_dir) / "secrets.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(env, f)
        out += ["--mount", f"type=bind,source={path},target={SECRETS_PATH},readonly"]
    return out, env


def _bind(value: str) -> str:
    parts = value.split(":")
    if len(parts) == 2:
        host, ctr, mode = parts[0], parts[1], ""
    elif len(parts) == 3:
        host, ctr, mode = parts
    else:
        raise ValueError(f"cannot translate mount {value!r}: paths must not contain ':'")
    if not host or not ctr:
        raise ValueError(f"cannot translate mount {value!r}: empty path")
    opts = [o for o in mode.split(",") if o]
    if any(o not in ("ro", "rw") for o in opts):
        raise ValueError(f"cannot translate mount option {mode!r} in {value!r}")
    spec = f"type=bind,source={host},target={ctr}"
    if "ro" in opts:
        spec += ",readonly"
    return spec


def run_args(spec: RunSpec, secrets_dir: Path | None = None) -> list[str]:
    """The full `container run ...` argv for `spec` (image and command last)."""
    args, _env = translate_args(docker_style_args(spec), secrets_dir)
    return ["container", "run", *args, spec.image, *(spec.command or [])]


class AppleContainerRuntime(ContainerRuntime):
    engine = "apple-container"

    def __init__(self, binary: str = "container") -> None:
        self.binary = binary
        self.description = f"the `{binary}` CLI"
        self._started = False
        self._lock = threading.Lock()

    def _run(self, *args: str, timeout: float = 120,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        if shutil.which(self.binary) is None:
            raise EngineUnavailable(f"`{self.binary}` is not installed (Apple container CLI)")
        p = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise EngineCallError(f"`{self.binary} {' '.join(args)}` failed: "
                                f"{(p.stderr or p.stdout).strip()[:500]}")
        return p

    def ensure_system_started(self) -> None:
        """`container system start` once per process (it is a no-op when already running)."""
        with self._lock:
            if self._started:
                return
            status = self._run("system", "status", check=False)
            if status.returncode != 0:
                p = self._run("system", "start", check=False, timeout=300)
                if p.returncode != 0:
                    raise EngineUnavailable(f"`{self.binary} system start` failed: "
                                            f"{(p.stderr or p.stdout).strip()[:300]}")
            self._started = True

    def ping(self) -> str:
        self.ensure_system_started()
        return self._run("--version").stdout.strip()

    def image_info(self, ref: str) -> ImageInfo | None:
        self.ensure_system_started()
        p = self._run("images", "inspect", ref, check=False)
        if p.returncode != 0:
            return None
        try:
            d = json.loads(p.stdout)
            d = d[0] if isinstance(d, list) else d
        except (ValueError, IndexError):
            d = {}
        return ImageInfo(ref=ref, id=str(d.get("digest", "")), tags=(ref,), created="", size=0)

    def build_image(self, tag: str, dockerfile: Path, context: Path,
                    progress: Callable[[str], None] | None = None,
                    build_args: dict[str, str] | None = None) -> str:
        self.ensure_system_started()
        args = [a for k, v in (build_args or {}).items() for a in ("--build-arg", f"{k}={v}")]
        proc = subprocess.Popen([self.binary, "build", "-t", tag, "-f", str(dockerfile),
                                 *args, str(context)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if progress and line.strip():
                progress(line.rstrip())
        if proc.wait() != 0:
            raise ImageError(f"build of {tag} failed (exit {proc.returncode})")
        return tag

    def load_image(self, tarball: Path,
                   progress: Callable[[str], None] | None = None) -> list[str]:
        self.ensure_system_started()
        p = self._run("images", "load", "-i", str(tarball), timeout=1800)
        if progress:
            for line in p.stdout.splitlines():
                progress(line)
        return [line.split(":", 1)[1].strip() for line in p.stdout.splitlines()
                if line.lower().startswith("loaded image")]

    def start(self, spec: RunSpec) -> RunningContainer:
        self.ensure_system_started()
        secrets_dir = Path(tempfile.mkdtemp(prefix="mdclaw-secrets-"))
        argv = run_args(spec, secrets_dir)
        argv[0] = self.binary
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        return _CliRun(proc, spec, secrets_dir)

    def stop(self, container_id: str, grace: float = 2.0) -> None:
        self._run("stop", container_id, check=False)

    def kill(self, container_id: str) -> None:
        self._run("kill", container_id, check=False)

    def remove(self, container_id: str) -> None:
        self._run("delete", "--force", container_id, check=False)

    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        self.ensure_system_started()
        p = self._run("list", "--format", "json", *(["--all"] if all else []))
        try:
            rows = json.loads(p.stdout or "[]")
        except ValueError:
            rows = []
        out = []
        for r in rows:
            cfg = r.get("configuration", r)
            row_labels = cfg.get("labels") or {}
            if any(row_labels.get(k) != v for k, v in labels.items()):
                continue
            cid = str(cfg.get("id", ""))
            out.append(ContainerInfo(id=cid, name=cid, state=str(r.get("status", "")),
                                     image=str((cfg.get("image") or {}).get("reference", "")),
                                     labels=row_labels))
        return out


class _CliRun(RunningContainer):
    def __init__(self, proc: subprocess.Popen[bytes], spec: RunSpec, secrets_dir: Path) -> None:
        self.proc = proc
        self.id = spec.name
        self.name = spec.name
        self._secrets_dir = secrets_dir
        threading.Thread(target=self._write, args=(spec.stdin,), daemon=True).start()

    def _write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.close()
        except OSError:
            pass

    def chunks(self) -> Iterator[tuple[Stream, bytes]]:
        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None and self.proc.stderr is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ, STDOUT)
        sel.register(self.proc.stderr, selectors.EVENT_READ, STDERR)
        open_streams = 2
        while open_streams:
            for key, _ in sel.select():
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                yield key.data, data
        sel.close()

    def wait(self, timeout: float | None = None) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            shutil.rmtree(self._secrets_dir, ignore_errors=True)

    def close(self) -> None:
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                if f:
                    f.close()
            except OSError:
                pass
