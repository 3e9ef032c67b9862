"""The runner's contract with the host: ContainerInput on stdin, marked results on stdout.

The contract is defined once, on the host (mdclaw/wire.py), and generated into
wire_schema.json beside this module (`python -m mdclaw wire-schema > ...`; a host test fails
while the committed file is stale). This module reads that schema: the markers, the
backends, the causes, the input's fields and defaults; stdin is checked against it
(schema_check) and so is every block `emit` writes. A key the schema does not have is
ignored when read (a newer host) and never written; a null is read as the key left out.

Only the standard library is used here so the host can import this module too (the host's
tests and the container runner parse the same markers).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mdclaw_agent.schema_check import errors

log = logging.getLogger("mdclaw_agent")

WIRE_SCHEMA_FILE = Path(__file__).with_name("wire_schema.json")
WIRE: dict[str, Any] = json.loads(WIRE_SCHEMA_FILE.read_text(encoding="utf-8"))
_INPUT: dict[str, Any] = WIRE["$defs"]["ContainerInput"]
_BLOCK: dict[str, Any] = WIRE["$defs"]["OutputBlock"]

OUTPUT_START: str = WIRE["x-output-start"]
OUTPUT_END: str = WIRE["x-output-end"]
BACKENDS: tuple[str, ...] = tuple(WIRE["$defs"]["Backend"]["enum"])
# Why a turn failed, as an error block's `cause` says it (the host maps each to what happens
# next and to the chat message; their meaning: mdclaw/wire.py and docs/agent.md).
CAUSES: tuple[str, ...] = tuple(WIRE["$defs"]["Cause"]["enum"])
PLACEHOLDER_KEY = "mdclaw-placeholder-key"


class InputError(ValueError):
    """The ContainerInput on stdin is missing a field or has a field of the wrong type."""


def _snake(key: str) -> str:
    """The Python name of a wire key (groupFolder -> group_folder)."""
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def _default(key: str) -> Any:
    """The default the host's schema gives input field `key`."""
    return _INPUT["properties"][key]["default"]


@dataclass(frozen=True)
class ContainerInput:
    """What the host tells the runner about this run. It never carries a secret.

    One field per property of the schema's ContainerInput (a test holds them equal), with
    the schema's defaults."""

    prompt: str
    group_folder: str
    chat_jid: str
    is_main: bool = _default("isMain")
    is_scheduled_task: bool = _default("isScheduledTask")
    assistant_name: str = _default("assistantName")
    session_id: str | None = _default("sessionId")
    backend: str = _default("backend")
    model: str | None = _default("model")

    @classmethod
    def from_json(cls, text: str) -> ContainerInput:
        """Parse the stdin document; raises InputError naming the field that is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"stdin is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise InputError("stdin must hold a JSON object (the ContainerInput)")
        data = {k: v for k, v in data.items() if v is not None}
        # Older hosts passed secrets in the input; they are ignored, never used or echoed.
        data.pop("secrets", None)
        nested = data.get("model")
        if isinstance(nested, dict):  # older hosts: "model": {"backend": ..., "model": ...}
            del data["model"]
            if nested.get("model") is not None:
                data["model"] = nested["model"]
            if not data.get("backend") and nested.get("backend") is not None:
                data["backend"] = nested["backend"]
        unknown = sorted(set(data) - set(_INPUT["properties"]))
        if unknown:
            log.info("ContainerInput field(s) this runner does not know, ignored: %s",
                     ", ".join(unknown))
            for key in unknown:
                del data[key]
        problems = errors(_INPUT, data, root=WIRE)
        if problems:
            raise InputError(f"ContainerInput: {'; '.join(problems)}")
        return cls(**{_snake(k): v for k, v in data.items()})


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


def block(status: str, result: str | None, *, new_session_id: str | None = None,
          error: str | None = None, info: dict[str, Any] | None = None,
          notice: dict[str, Any] | None = None) -> dict[str, Any]:
    """One result as the schema's OutputBlock, checked against it. A block the host would
    not read (a bug here) becomes an agent_crash error block saying what was wrong.

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
    problems = errors(_BLOCK, body, root=WIRE)
    if problems:
        log.error("output block breaks the wire schema (%s): %r", "; ".join(problems), body)
        return {"status": "error", "result": None,
                "error": f"the agent runner wrote a malformed result: {'; '.join(problems)}",
                "cause": "agent_crash"}
    return body


def emit(status: str, result: str | None, *, new_session_id: str | None = None,
         error: str | None = None, info: dict[str, Any] | None = None,
         notice: dict[str, Any] | None = None, stream: TextIO | None = None) -> None:
    """Print one result (`block`) between the output markers as a single JSON line, and
    flush."""
    body = block(status, result, new_session_id=new_session_id, error=error, info=info,
                 notice=notice)
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
