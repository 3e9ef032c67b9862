"""What every tool is built from: the Tool record, the context it runs in, its error.

Kept apart from the registry (tools.py) so the modules that hold groups of handlers
(filetools, shell) can use them too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

    def call(self, ctx: ToolContext, args: dict[str, Any]) -> str:
        """Run the tool after checking the arguments against its whole schema (types, enums,
        arrays, nested objects, lengths, required and unknown keys). A null or empty-string
        argument counts as not given (models send both for arguments they mean to leave
        out), so an empty required one is missing."""
        if not isinstance(args, dict):
            raise ToolError(f"{self.name}: arguments must be an object")
        given = {k: v for k, v in args.items() if v is not None and v != ""}
        problems = errors(self.parameters, given)
        if problems:
            raise ToolError(f"{self.name}: {'; '.join(problems)}")
        return self.handler(ctx, given)


def schema(required: list[str], **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}
