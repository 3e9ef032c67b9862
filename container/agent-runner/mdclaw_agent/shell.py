"""The `bash` tool: one command in the group folder, in its own process group, with a
timeout, its output capped (head and tail kept).

The command runs as `bash -c <command>` with stdin closed, in a new session (so its process
group holds it and everything it starts that does not leave the group on purpose). When the
timeout passes, the group gets SIGTERM, then SIGKILL after a grace period. When the command
ends in time, whatever it left running in its group is killed too: nothing started by one
call outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from typing import IO, Any

from mdclaw_agent.toolbase import Tool, ToolContext, ToolError, schema, string

DEFAULT_TIMEOUT = 120.0
STREAM_CAP = 30_000      # bytes kept of stdout and of stderr each (half head, half tail)
KILL_GRACE = 2.0         # seconds between SIGTERM and SIGKILL
DRAIN_WAIT = 2.0         # seconds to wait for the pipes to close once the group is gone


class CappedStream:
    """Reads a pipe to its end in a thread, keeping the first and the last `cap/2` bytes."""

    def __init__(self, pipe: IO[bytes], cap: int = STREAM_CAP) -> None:
        self.half = cap // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self._pipe = pipe
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                chunk = self._pipe.read1(65536)  # type: ignore[attr-defined]
                if not chunk:
                    return
                self.total += len(chunk)
                room = self.half - len(self.head)
                if room > 0:
                    self.head += chunk[:room]
                    chunk = chunk[room:]
                if chunk:
                    self.tail += chunk
                    if len(self.tail) > self.half:
                        del self.tail[:len(self.tail) - self.half]
        except (OSError, ValueError):
            return

    def text(self) -> str:
        kept = len(self.head) + len(self.tail)
        head = self.head.decode("utf-8", errors="replace")
        if self.total <= kept:
            return head + self.tail.decode("utf-8", errors="replace")
        cut = self.total - kept
        return (head + f"\n[... {cut} bytes cut: output capped at {2 * self.half} bytes, "
                "first and last part kept ...]\n" + self.tail.decode("utf-8", errors="replace"))


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group, SIGKILL what is left after `grace` seconds."""
    pgid = proc.pid
    _killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            return
        time.sleep(0.02)
    _killpg(pgid, signal.SIGKILL)


def run_bash(command: str, *, cwd: str, timeout: float,
             grace: float = KILL_GRACE, cap: int = STREAM_CAP) -> dict[str, Any]:
    """Run `command`; return {exit_code, stdout, stderr, timed_out, duration_s}."""
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    out, err = CappedStream(proc.stdout, cap), CappedStream(proc.stderr, cap)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop_group(proc, grace)
    finally:
        # Whatever the command left running in its group goes too.
        _killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for s in (out, err):
        s.thread.join(DRAIN_WAIT)
    code = proc.returncode
    return {"exit_code": code, "stdout": out.text(), "stderr": err.text(),
            "timed_out": timed_out, "duration_s": round(time.monotonic() - start, 3)}


def _bash(ctx: ToolContext, a: dict[str, Any]) -> str:
    limit = ctx.tool_timeout_max
    timeout = float(a.get("timeout", min(DEFAULT_TIMEOUT, limit)))
    if timeout > limit:
        raise ToolError(f"bash: timeout {timeout:g} s is over this group's limit of "
                        f"{limit:g} s")
    try:
        result = run_bash(a["command"], cwd=str(ctx.group_dir), timeout=timeout)
    except OSError as e:
        raise ToolError(f"bash: could not start the command: {e.strerror or e}") from None
    if result["timed_out"]:
        result["note"] = (f"the command did not end within {timeout:g} s; its process group "
                          "was stopped (SIGTERM, then SIGKILL)")
    return json.dumps(result, ensure_ascii=False)


BASH_TOOL = Tool(
    "bash",
    "Run a shell command with bash -c in the group folder /workspace/group (no network). "
    f"Timeout {DEFAULT_TIMEOUT:g} s unless you give another (up to this group's limit); the "
    "command and everything it started are stopped then. Returns JSON: exit_code, stdout, "
    f"stderr (each capped at {STREAM_CAP} bytes, first and last part kept), timed_out. "
    "Processes left running when the command ends are stopped too.",
    schema(["command"], command=string("The command line."),
           timeout={"type": "number", "minimum": 1,
                    "description": f"Seconds before it is stopped (default "
                                   f"{DEFAULT_TIMEOUT:g})."}),
    _bash, tags=("workspace",))
