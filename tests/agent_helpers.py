"""Helpers for the agent tests: the real runner in a subprocess, the real proxy in a thread."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUNNER_SRC = REPO / "container" / "agent-runner"
if str(RUNNER_SRC) not in sys.path:
    sys.path.insert(0, str(RUNNER_SRC))

from mdclaw_agent.protocol import OUTPUT_END, OUTPUT_START  # noqa: E402


class RunnerProcess:
    """`python -m mdclaw_agent` with ContainerInput on stdin; results collected as they come."""

    def __init__(self, container_input: dict[str, Any], *, ipc_dir: Path, group_dir: Path,
                 global_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("MDCLAW_", "ANTHROPIC_", "OPENAI_"))}
        full_env.update({
            "PYTHONPATH": str(RUNNER_SRC),
            "MDCLAW_IPC_DIR": str(ipc_dir),
            "MDCLAW_GROUP_DIR": str(group_dir),
            "MDCLAW_GLOBAL_DIR": str(global_dir or group_dir.parent / "global"),
            "MDCLAW_AGENT_LOG": "INFO",
            # Where the host's proxy serves this group (data_dir/proxy/<folder>/), as the
            # container sees it at /workspace/proxy.
            "MDCLAW_PROXY_SOCKET": str(ipc_dir.parent.parent / "proxy" / ipc_dir.name
                                       / "proxy.sock"),
        })
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mdclaw_agent"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, text=True)
        self.results: list[dict[str, Any]] = []
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []
        self._cv = threading.Condition()
        self.proc.stdin.write(json.dumps(container_input))
        self.proc.stdin.close()
        self._readers = [threading.Thread(target=self._read_out, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._readers:
            t.start()

    def _read_out(self) -> None:
        inside = False
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._cv:
                self.stdout_lines.append(line)
                if line == OUTPUT_START:
                    inside = True
                elif line == OUTPUT_END:
                    inside = False
                elif inside:
                    self.results.append(json.loads(line))
                self._cv.notify_all()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    def wait_results(self, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        exited_at = None
        with self._cv:
            while len(self.results) < n:
                now = time.monotonic()
                if self.proc.poll() is not None:
                    exited_at = exited_at or now
                if now >= deadline or (exited_at is not None and now - exited_at > 1.0):
                    raise AssertionError(
                        f"expected {n} result(s), got {self.results}; stderr:\n"
                        + "\n".join(self.stderr_lines[-30:]))
                self._cv.wait(0.1)
            return list(self.results)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """The exit status, once the process ended AND its output was read to the end (the
        reader threads may still hold the last lines when the process is gone)."""
        deadline = time.monotonic() + timeout
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("runner did not exit; stderr:\n"
                                 + "\n".join(self.stderr_lines[-30:])) from None
        for t in self._readers:
            t.join(max(deadline - time.monotonic(), 1.0))
            if t.is_alive():
                raise AssertionError("the runner exited but its output was not read to the end")
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class ProxyThread:
    """The real CredentialProxy on its own event loop thread."""

    def __init__(self, layout, db=None) -> None:  # noqa: ANN001
        from mdclaw.proxy import CredentialProxy

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxy = self.call(self._make(CredentialProxy, layout, db))

    @staticmethod
    async def _make(cls, layout, db):  # noqa: ANN001, ANN205
        return cls(layout, db)

    def call(self, coro, timeout: float = 30.0):  # noqa: ANN001, ANN201
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_group(self, folder: str, upstream) -> Path:  # noqa: ANN001
        return self.call(self.proxy.start_group(folder, upstream))

    def flush(self) -> None:
        self.call(self.proxy.ledger.flush())

    def close(self) -> None:
        self.call(self.proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def write_input(input_dir: Path, body: dict[str, Any] | None, name: str) -> Path:
    """Write a follow-up (or `_close` when body is None) atomically, as the host does."""
    input_dir.mkdir(parents=True, exist_ok=True)
    final = input_dir / name
    tmp = input_dir / f".{name}.tmp"
    tmp.write_text("" if body is None else json.dumps(body))
    os.replace(tmp, final)
    return final
