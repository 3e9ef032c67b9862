"""JSON-RPC 2.0 as MCP uses it, and the stdio framing (one message a line), capped.

Pure: no I/O. `LineFramer` cuts a byte stream into lines of at most `limit` bytes; a longer
line is skipped as it streams past (only its first bytes are kept, to find which request it
answered), so a 50 MiB line costs a scan for the newline, never a 50 MiB buffer or a parse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mdclaw.errors import IpcError

# The initialize handshake's revisions this client speaks, newest first (it offers the first).
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
CLIENT_INFO = {"name": "mdclaw", "version": "0.1.0"}
# No sampling, roots or elicitation: a server must never drive the model or see the host's
# folders, and nobody is there to answer a form.
CLIENT_CAPABILITIES: dict[str, Any] = {}

HEAD_BYTES = 4096  # kept of an oversized line, to find its id

# JSON-RPC error codes
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602


class McpError(IpcError):
    """A call to an MCP server did not give a result; the message says why, for the agent and
    the operator (never a secret). `outcome` is the metrics' label for it."""

    outcome = "error"


class ServerDown(McpError):
    """The server is not running (it exited, could not start, or is waiting to restart)."""
    outcome = "server_down"


class ServerCrashed(McpError):
    """The server went away while the call was under way."""
    outcome = "crashed"


class CallTimeout(McpError):
    """The server did not answer within the call's time."""
    outcome = "timeout"


class TooLarge(McpError):
    """The server's answer was larger than `max_result_bytes`."""
    outcome = "too_large"


class ProtocolFailure(McpError):
    """The server answered with a JSON-RPC error, or something that is not an answer."""
    outcome = "protocol_error"


class Refused(McpError):
    """The host refused the call before it reached the server (not allowed, not assigned,
    arguments that break the tool's schema)."""
    outcome = "refused"


@dataclass(frozen=True)
class Oversize:
    """A line longer than the framer's limit: its first bytes and its length."""
    head: bytes
    size: int

    def request_id(self) -> int | str | None:
        """The id of the message, when the head shows it (servers write `id` before
        `result`); None when it does not."""
        return id_in_head(self.head)


_ID = re.compile(rb'^\s*\{(?:[^{}]*?,)?\s*"id"\s*:\s*(-?\d+|"(?:[^"\\]|\\.){0,200}")')


def id_in_head(head: bytes) -> int | str | None:
    """The top-level `id` of a JSON-RPC message from its first bytes, if it comes before any
    nested object. A line that starts with garbage (a server that printed to stdout without
    a newline) is read from its first `{"jsonrpc"`, as the client reads a short one."""
    m = _ID.match(head)
    if not m:
        at = head.find(b'{"jsonrpc"', 1)
        m = _ID.match(head[at:]) if at > 0 else None
    if not m:
        return None
    raw = m.group(1)
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, int | str) else None


class LineFramer:
    """Cuts bytes into lines (without the newline) of at most `limit` bytes; a longer line is
    reported as `Oversize` once it ends, its bytes never kept. Blank lines are skipped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._skipping = False
        self._head = b""
        self._skipped = 0

    def feed(self, data: bytes) -> list[bytes | Oversize]:
        out: list[bytes | Oversize] = []
        start = 0
        n = len(data)
        while start < n:
            nl = data.find(b"\n", start)
            end = n if nl < 0 else nl
            piece = data[start:end]
            if self._skipping:
                self._skipped += len(piece)
            elif len(self._buf) + len(piece) > self.limit:
                whole = bytes(self._buf) + piece
                self._head = whole[:HEAD_BYTES]
                self._skipped = len(whole)
                self._buf.clear()
                self._skipping = True
            else:
                self._buf += piece
            if nl < 0:
                break
            if self._skipping:
                out.append(Oversize(self._head, self._skipped))
                self._skipping, self._head, self._skipped = False, b"", 0
            else:
                line = bytes(self._buf).strip()
                self._buf.clear()
                if line:
                    out.append(line)
            start = nl + 1
        return out

    def pending(self) -> int:
        """Bytes of an unfinished line held (or skipped) so far."""
        return self._skipped if self._skipping else len(self._buf)


def request(msg_id: int, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": msg_id, "method": method}
    if params is not None:
        body["params"] = params
    return body


def notification(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        body["params"] = params
    return body


def response(msg_id: Any, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "result": result}


def error_response(msg_id: Any, code: int, message: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": msg_id, "error": {"code": code, "message": message}}


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a stdio line (JSON never holds a raw newline)."""
    return json.dumps(msg, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def kind(msg: Any) -> str:
    """"response", "request", "notification" or "invalid"."""
    if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
        return "invalid"
    if "method" in msg:
        if not isinstance(msg["method"], str):
            return "invalid"
        return "request" if "id" in msg else "notification"
    if "id" in msg and ("result" in msg or "error" in msg):
        return "response"
    return "invalid"


def error_text(err: Any) -> str:
    """A JSON-RPC error object as words: its message and code."""
    if not isinstance(err, dict):
        return "an unreadable error"
    msg = str(err.get("message") or "no message")[:500]
    return f"{msg} (JSON-RPC error {err.get('code')})"
