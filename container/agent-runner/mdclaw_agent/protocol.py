"""The runner's contract with the host: ContainerInput on stdin, marked results on stdout.

Only the standard library is used here so the host can import this module too (the host's
tests and the container runner parse the same markers).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

OUTPUT_START = "---NANOCLAW_OUTPUT_START---"
OUTPUT_END = "---NANOCLAW_OUTPUT_END---"
BACKENDS = ("claude", "openai")
PLACEHOLDER_KEY = "mdclaw-placeholder-key"
# Why a turn failed, as the runner reports it in an error block's `cause` (the host maps each
# to what happens next and to the chat message: mdclaw/failures.py). A fixed set: the host
# treats anything else as "agent_crash".
CAUSES = (
    "model_unreachable",   # nothing answers at the model's address (connection refused...)
    "model_disconnected",  # the model server closed the connection without a full answer
    "model_server_error",  # HTTP 5xx from the model server
    "rate_limited",        # HTTP 429 (retryAfter: seconds, when the API said)
    "over_budget",         # the account is out of credit/quota (HTTP 402, insufficient_quota)
    "context_too_long",    # the request is over the model's context (limit: what the API said)
    "model_refused",       # any other HTTP 4xx (httpStatus, apiMessage)
    "model_malformed",     # the answer was not the API's JSON (twice in a row)
    "turn_timeout",        # no answer from the model in time
    "tool_crash",          # a tool raised an unexpected error
    "agent_crash",         # the runner itself failed (a bug)
    "backend_missing",     # the backend the group needs is not in this image
    "key_missing",         # the host cannot read the model's key file (said by the proxy)
    "proxy_missing",       # the credential proxy's socket is not there
    "invalid_input",       # the ContainerInput on stdin was wrong (a host bug)
)


class InputError(ValueError):
    """The ContainerInput on stdin is missing a field or has a field of the wrong type."""


@dataclass(frozen=True)
class ContainerInput:
    """What the host tells the runner about this run. It never carries a secret."""

    prompt: str
    group_folder: str
    chat_jid: str
    is_main: bool = False
    is_scheduled_task: bool = False
    assistant_name: str = "Andy"
    session_id: str | None = None
    backend: str = "claude"
    model: str | None = None

    @classmethod
    def from_json(cls, text: str) -> ContainerInput:
        """Parse the stdin document; raises InputError naming the field that is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"stdin is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise InputError("stdin must hold a JSON object (the ContainerInput)")
        # Older hosts passed secrets in the input; they are ignored, never used or echoed.
        data.pop("secrets", None)

        def get(key: str, kind: type | tuple[type, ...], default: Any = ..., *,
                required: bool = False) -> Any:
            if key not in data or data[key] is None:
                if required:
                    raise InputError(f"ContainerInput field {key!r} is required")
                return None if default is ... else default
            value = data[key]
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise InputError(f"ContainerInput field {key!r} has the wrong type "
                                 f"({type(value).__name__})")
            return value

        model = data.get("model")
        backend = data.get("backend")
        if isinstance(model, dict):  # {"backend": ..., "model": ...} form
            backend = backend or model.get("backend")
            model = model.get("model")
        backend = backend or "claude"
        if backend not in BACKENDS:
            raise InputError(f"ContainerInput field 'backend' must be one of {BACKENDS}, "
                             f"got {backend!r}")
        if model is not None and not isinstance(model, str):
            raise InputError("ContainerInput field 'model' must be a string")
        return cls(
            prompt=get("prompt", str, required=True),
            group_folder=get("groupFolder", str, required=True),
            chat_jid=get("chatJid", str, ""),
            is_main=get("isMain", bool, False),
            is_scheduled_task=get("isScheduledTask", bool, False),
            assistant_name=get("assistantName", str, "Andy"),
            session_id=get("sessionId", str, None) or None,
            backend=backend,
            model=model,
        )


@dataclass(frozen=True)
class Settings:
    """Where things are inside the container; every path can be moved by an environment
    variable so the runner also runs on a host for tests."""

    ipc_dir: Path
    group_dir: Path
    global_dir: Path
    proxy_socket: Path
    model_base_url: str | None
    input_poll_seconds: float
    action_timeout_seconds: float
    max_tool_rounds: int
    history_chars: int = 200_000
    extra_dir: Path = Path("/workspace/extra")
    tool_timeout_max: float = 600.0
    web_timeout_seconds: float = 60.0
    # The host actions this group may call (MDCLAW_ACTIONS, comma-separated); None: not told.
    allowed_actions: frozenset[str] | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        ipc = Path(env.get("MDCLAW_IPC_DIR", "/workspace/ipc"))
        return cls(
            ipc_dir=ipc,
            group_dir=Path(env.get("MDCLAW_GROUP_DIR", "/workspace/group")),
            global_dir=Path(env.get("MDCLAW_GLOBAL_DIR", "/workspace/global")),
            proxy_socket=Path(env.get("MDCLAW_PROXY_SOCKET", "/workspace/proxy/proxy.sock")),
            model_base_url=env.get("MDCLAW_MODEL_BASE_URL") or None,
            input_poll_seconds=float(env.get("MDCLAW_INPUT_POLL_MS", "500")) / 1000,
            action_timeout_seconds=float(env.get("MDCLAW_ACTION_TIMEOUT", "30")),
            max_tool_rounds=int(env.get("MDCLAW_MAX_TOOL_ROUNDS", "16")),
            history_chars=int(env.get("MDCLAW_HISTORY_CHARS", "200000")),
            extra_dir=Path(env.get("MDCLAW_EXTRA_DIR", "/workspace/extra")),
            tool_timeout_max=float(env.get("MDCLAW_TOOL_TIMEOUT_MAX", "600")),
            web_timeout_seconds=float(env.get("MDCLAW_WEB_TIMEOUT", "60")),
            allowed_actions=(frozenset(a for a in env["MDCLAW_ACTIONS"].split(",") if a)
                             if "MDCLAW_ACTIONS" in env else None),
        )


_out_lock = threading.Lock()


def emit(status: str, result: str | None, *, new_session_id: str | None = None,
         error: str | None = None, info: dict[str, Any] | None = None,
         notice: dict[str, Any] | None = None, stream: TextIO | None = None) -> None:
    """Print one result between the output markers as a single JSON line, and flush.

    An error carries `info`: its `cause` (one of CAUSES) and the details for the host
    (httpStatus, apiMessage, retryAfter, limit). A success may carry a `notice` for the chat.
    """
    body: dict[str, Any] = {"status": status, "result": result}
    if new_session_id:
        body["newSessionId"] = new_session_id
    if error:
        body["error"] = error
    if info:
        body.update(info)
    if notice:
        body["notice"] = notice
    line = json.dumps(body, ensure_ascii=False)
    out = stream or sys.stdout
    with _out_lock:
        out.write(f"{OUTPUT_START}\n{line}\n{OUTPUT_END}\n")
        out.flush()


def parse_outputs(text: str) -> list[dict[str, Any]]:
    """Every marked result in `text`, in order (what the host does with the stream)."""
    results: list[dict[str, Any]] = []
    pos = 0
    while True:
        start = text.find(OUTPUT_START, pos)
        if start < 0:
            return results
        end = text.find(OUTPUT_END, start)
        if end < 0:
            return results
        results.append(json.loads(text[start + len(OUTPUT_START):end].strip()))
        pos = end + len(OUTPUT_END)
