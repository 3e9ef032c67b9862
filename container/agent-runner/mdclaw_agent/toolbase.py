"""What every tool is built from: the Tool record, the context it runs in, its error, and
the one way to write a command or ask the host for an action and wait for its answer.

Kept apart from the registry (tools.py) so the modules that hold groups of handlers
(filetools, shell, hatools) can use them too.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mdclaw_agent import commands
from mdclaw_agent.ipc import read_json_file, write_json_atomic
from mdclaw_agent.schema_check import errors


class ToolError(Exception):
    """The tool could not do what was asked; the message says why, for the agent."""


@dataclass(frozen=True)
class ToolContext:
    """What the tools know about this container."""

    ipc_dir: Path
    group_folder: str
    chat_jid: str
    is_main: bool
    group_dir: Path = Path("/workspace/group")
    action_timeout: float = 30.0
    global_dir: Path = Path("/workspace/global")
    extra_dir: Path = Path("/workspace/extra")
    # The longest a bash call may ask for (the host's limits.tool_timeout for this group).
    tool_timeout_max: float = 600.0
    # How long a web_fetch / web_search waits for the host's answer.
    web_timeout: float = 60.0
    # The chat of the message being answered, when a follow-up came from another chat of
    # the group than `chat_jid` (the runner sets it): the tools' default target.
    answering: list[str] = field(default_factory=list)

    def default_chat(self) -> str:
        """Where a message or file goes when the agent names no chat: the chat of the
        message it answers."""
        return self.answering[-1] if self.answering else self.chat_jid

    def answer_in(self, chat: str | None) -> None:
        """The turn now answered came from `chat` (None: the first prompt's chat)."""
        self.answering[:] = [chat] if chat else []


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments (an object)
    handler: Callable[[ToolContext, dict[str, Any]], str]
    main_only: bool = False
    tags: tuple[str, ...] = field(default=())
    # The host action this tool asks for: when the host lists the actions this group may
    # call (MDCLAW_ACTIONS), the tool is given exactly when its action is listed.
    action: str | None = None
    # False for a schema that is not mdclaw's own (an MCP server's): keywords the check does
    # not know are left to the host, which checks those arguments completely.
    strict_schema: bool = True

    def call(self, ctx: ToolContext, args: dict[str, Any]) -> str:
        """Run the tool after checking the arguments against its whole schema (types, enums,
        arrays, nested objects, lengths, required and unknown keys). A null or empty-string
        argument counts as not given (models send both for arguments they mean to leave
        out), so an empty required one is missing."""
        if not isinstance(args, dict):
            raise ToolError(f"{self.name}: arguments must be an object")
        given = {k: v for k, v in args.items() if v is not None and v != ""}
        problems = errors(self.parameters, given, strict=self.strict_schema)
        if problems:
            raise ToolError(f"{self.name}: {'; '.join(problems)}")
        return self.handler(ctx, given)


def schema(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


# --------------------------------------------------------------------------- host requests


def write_command(ctx: ToolContext, subdir: str, body: dict[str, Any]) -> Path:
    """Write one canonical command into `ipc/<subdir>/`; raises ToolError if it cannot, or if
    the host's schema refuses the body (then nothing is written)."""
    problems = commands.problems(body)
    if problems:
        raise ToolError(f"{body.get('type')}: {'; '.join(problems)}")
    try:
        return write_json_atomic(ctx.ipc_dir / subdir, body)
    except OSError as e:
        raise ToolError(f"could not write the {body.get('type')} request: {e.strerror}") from None


# How long after an approval's expiry the tool still waits for the host's final answer.
APPROVAL_GRACE = 30.0


def _seconds_until(iso: Any) -> float | None:
    """Seconds from now until the ISO time `iso` (None if it is not one)."""
    if not isinstance(iso, str):
        return None
    try:
        when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when - datetime.now(UTC)).total_seconds()


def request_action(ctx: ToolContext, body: dict[str, Any],
                   timeout: float | None = None) -> dict[str, Any]:
    """Write an action request and wait for `action_results/<requestId>.json`.

    Returns the result envelope; raises ToolError on timeout. The result file is removed
    once read. While the host's answer is the interim `{"status": "pending_approval",
    "approver", "expiresAt"}` (a person must say yes first, or answer a question), the tool
    keeps waiting until the expiry (plus a grace): the final answer replaces that file.
    """
    request_id = f"req-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
    results = ctx.ipc_dir / "action_results"
    write_command(ctx, "actions", {"type": "action", "request_id": request_id, **body})
    path = results / f"{request_id}.json"
    wait = ctx.action_timeout if timeout is None else timeout
    deadline = time.monotonic() + wait
    delay = 0.01
    while True:
        try:
            envelope = read_json_file(path, limit=16 * 1024 * 1024)
        except FileNotFoundError:
            envelope = None
        except (OSError, ValueError) as e:
            raise ToolError(f"the host's answer to {request_id} is unreadable: {e}") from None
        if isinstance(envelope, dict) and envelope.get("status") == "pending_approval":
            left = _seconds_until(envelope.get("expiresAt"))
            if left is not None:
                wait_more = max(0.0, left) + APPROVAL_GRACE
                if time.monotonic() + wait_more > deadline:
                    deadline = time.monotonic() + wait_more
                    wait = max(wait, wait_more)
            envelope = None  # not the answer yet: the host writes the final one over it
        if envelope is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
            if not isinstance(envelope, dict):
                raise ToolError(f"the host's answer to {request_id} is not an object")
            return envelope
        if time.monotonic() >= deadline:
            raise ToolError(f"no answer from the host to {body.get('action')} within "
                            f"{wait:g} s (request {request_id})")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def action_result(envelope: dict[str, Any], what: str) -> Any:
    """The result of a host's answer envelope; ToolError naming `what` if it failed."""
    if envelope.get("status") != "success":
        raise ToolError(f"{what} failed: {envelope.get('error') or 'no reason given'}")
    return envelope.get("result")
