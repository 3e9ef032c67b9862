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
        )


_out_lock = threading.Lock()


def emit(status: str, result: str | None, *, new_session_id: str | None = None,
         error: str | None = None, stream: TextIO | None = None) -> None:
    """Print one result between the output markers as a single JSON line, and flush."""
    body: dict[str, Any] = {"status": status, "result": result}
    if new_session_id:
        body["newSessionId"] = new_session_id
    if error:
        body["error"] = error
    line = json.dumps(body, ensure_ascii=False)
    out = stream or sys.stdout
    with _out_lock:
        out.write(f"{OUTPUT_START}\n{line}\n{OUTPUT_END}\n")
        out.flush()


def parse_outputs(text: str) -> list[dict[str, Any]]:
    """Every marked result in `text`, in order (what the host does with the stream)."""
    results = []
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
