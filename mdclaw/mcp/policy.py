"""Who may call which MCP tool, under which name, with which arguments, and whether a person
must approve it. Pure: the config and the servers' tool lists in, decisions out.

- A tool is offered to agents as `<server>__<tool>` (a server name has no double underscore,
  so the name splits one way only); a tool whose name a model API would refuse (characters
  other than letters, digits, `_` and `-`, or longer than MAX_NAME together), or whose input
  schema is not a valid JSON Schema of an object, is not offered, and `tool_problem` says why.
- `refusal`: the rule that refuses group `g` a call: the server not in `groups.<g>.mcp`, the
  tool matching none of its patterns, the tool unknown to the server.
- `argument_problems`: the arguments checked against the tool's input schema with the
  `jsonschema` library (the draft the schema names, 2020-12 by default): the host's complete
  check, whatever the agent's runner checked before.
- `needs_approval`: a tool needs a person's approval unless its annotations say read-only
  and not destructive; `mcp_servers.<s>.approve` tightens (`always`) or loosens (`never`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from mdclaw.approvals.rules import has_owner
from mdclaw.config import Config

SEPARATOR = "__"
MAX_NAME = 64  # of `<server>__<tool>`: OpenAI's limit for function names
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]+\Z")
MAX_DESCRIPTION = 2000
MAX_SCHEMA_BYTES = 64 * 1024
MAX_ARGUMENT_PROBLEMS = 10


@dataclass(frozen=True)
class ToolEntry:
    """One tool of one server, as the host keeps and offers it."""
    server: str
    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] = field(default_factory=dict)
    title: str | None = None

    @property
    def offered(self) -> str:
        return offered_name(self.server, self.name)


def offered_name(server: str, tool: str) -> str:
    return f"{server}{SEPARATOR}{tool}"


def tool_problem(server: str, tool: Any) -> str | None:
    """Why a tool of `server`'s list cannot be offered; None when it can."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        return "a tool without a name"
    name = tool["name"]
    if not _TOOL_NAME.match(name):
        return (f"tool {name[:80]!r}: its name has characters model APIs refuse (only "
                "letters, digits, '_' and '-')")
    if len(offered_name(server, name)) > MAX_NAME:
        return (f"tool {name!r}: {offered_name(server, name)!r} is longer than {MAX_NAME} "
                "characters (give the server a shorter name)")
    schema = tool.get("inputSchema")
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return f"tool {name!r}: its inputSchema is not a JSON Schema of an object"
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        return f"tool {name!r}: its inputSchema is larger than {MAX_SCHEMA_BYTES} bytes"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        return f"tool {name!r}: its inputSchema is not valid: {e.message[:200]}"
    return None


def entries(server: str, tools: list[dict[str, Any]]) -> tuple[list[ToolEntry], list[str]]:
    """The server's offerable tools, and why each other one is not offered."""
    out: list[ToolEntry] = []
    problems: list[str] = []
    seen: set[str] = set()
    for t in tools:
        why = tool_problem(server, t)
        if why is None and t["name"] in seen:
            why = f"tool {t['name']!r} is listed twice"
        if why is not None:
            problems.append(why)
            continue
        seen.add(t["name"])
        desc = t.get("description")
        ann = t.get("annotations")
        title = t.get("title") if isinstance(t.get("title"), str) else None
        schema = dict(t["inputSchema"])
        schema.setdefault("type", "object")
        out.append(ToolEntry(server, t["name"],
                             desc[:MAX_DESCRIPTION] if isinstance(desc, str) else "",
                             schema, ann if isinstance(ann, dict) else {}, title))
    return out, problems


# --------------------------------------------------------------------------- who may call


def group_patterns(cfg: Config, folder: str, server: str) -> tuple[str, ...] | None:
    """The patterns of `groups.<folder>.mcp.<server>`; None when the server is not there."""
    group = cfg.groups.get(folder)
    if group is None or not group.mcp:
        return None
    return group.mcp.get(server)


def refusal(cfg: Config, folder: str, server: str, tool: str,
            known: list[ToolEntry] | None) -> str | None:
    """Why group `folder` may not call `tool` of `server`, naming the rule; None if it may.
    `known`: the server's tools as last listed (None: not listed yet)."""
    if server not in cfg.mcp_servers:
        return f"there is no MCP server {server!r} (mcp_servers)"
    patterns = group_patterns(cfg, folder, server)
    if patterns is None:
        return (f"MCP server {server!r} is not assigned to group {folder!r}: "
                f"groups.{folder}.mcp has no {server!r}")
    if not any(fnmatchcase(tool, p) for p in patterns):
        return (f"tool {tool!r} of {server!r} is not allowed for group {folder!r}: "
                f"groups.{folder}.mcp.{server} ({', '.join(patterns) or 'empty'}) matches "
                "no such tool")
    if known is not None and not any(t.name == tool for t in known):
        return f"MCP server {server!r} has no tool {tool!r}"
    return None


def allowed_tools(cfg: Config, folder: str,
                  catalog: dict[str, list[ToolEntry]]) -> list[ToolEntry]:
    """The tools group `folder` may call, server by server in the config's order."""
    group = cfg.groups.get(folder)
    if group is None or not group.mcp:
        return []
    out = []
    for server, patterns in group.mcp.items():
        for t in catalog.get(server, []):
            if any(fnmatchcase(t.name, p) for p in patterns):
                out.append(t)
    return out


def snapshot(cfg: Config, folder: str, catalog: dict[str, list[ToolEntry]]) -> dict[str, Any]:
    """What `ipc/<folder>/mcp_tools.json` holds: the tools the group may call, each with the
    longest the runner should wait for its answer (the call's timeout and some)."""
    tools = []
    for t in allowed_tools(cfg, folder, catalog):
        spec = cfg.mcp_servers[t.server]
        entry: dict[str, Any] = {
            "name": t.offered, "server": t.server, "tool": t.name,
            "description": t.description, "inputSchema": t.input_schema,
            "annotations": t.annotations,
            "timeout": round(spec.timeout.total_seconds() + 15, 1)}
        if t.title:
            entry["title"] = t.title
        tools.append(entry)
    return {"version": 1, "tools": tools}


# --------------------------------------------------------------------------- arguments


@lru_cache(maxsize=512)
def _validator(schema_json: str) -> Any:
    schema = json.loads(schema_json)
    return jsonschema.validators.validator_for(schema)(schema)


def argument_problems(schema: dict[str, Any], arguments: Any) -> list[str]:
    """Every way `arguments` break the tool's input schema (at most MAX_ARGUMENT_PROBLEMS),
    each naming where; [] when they fit."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    out = []
    for err in validator.iter_errors(arguments):
        where = "/".join(str(p) for p in err.absolute_path) or "the arguments"
        out.append(f"{where}: {err.message[:200]}")
        if len(out) >= MAX_ARGUMENT_PROBLEMS:
            break
    return out


# --------------------------------------------------------------------------- approval


def _any(annotations: dict[str, Any]) -> bool:
    return True


def _destructive(annotations: dict[str, Any]) -> bool:
    return annotations.get("destructiveHint") is True


def _not_read_only(annotations: dict[str, Any]) -> bool:
    return annotations.get("readOnlyHint") is not True


@dataclass(frozen=True)
class DefaultStep:
    """One step of the MCP default: applied when no approval rule matched a call, the steps
    tried in order, the first whose `tools` pattern and annotation condition hold decides.
    `source` names where it comes from (the approval's rule when it holds a call)."""

    source: str
    tools: str  # fnmatch pattern of the server's tool names
    when: str | None  # the condition on the tool's annotations, in words (None: any)
    needs_owner: bool
    applies: Callable[[dict[str, Any]], bool] = field(default=_any, repr=False, compare=False)


def default_steps(cfg: Config, server: str) -> list[DefaultStep]:
    """The default for the tools of `server`, in the order tried: `approve.always` patterns
    (a person), `approve.never` patterns (nobody), then the annotations: destructive or not
    read-only needs a person; what is left (read-only, not destructive) nobody. An unknown
    server always needs one. The one definition `approval_reason` decides with and
    `mdclaw approvals rules` lists."""
    spec = cfg.mcp_servers.get(server)
    if spec is None:
        return [DefaultStep(f"mcp_servers has no {server!r}", "*", None, True)]
    base = f"mcp_servers.{server}"
    return [
        *(DefaultStep(f"{base}.approve.always", p, None, True) for p in spec.approve.always),
        *(DefaultStep(f"{base}.approve.never", p, None, False) for p in spec.approve.never),
        DefaultStep(f"{base}: tool annotations (destructive)", "*", "destructiveHint: true",
                    True, _destructive),
        DefaultStep(f"{base}: tool annotations (not read-only)", "*",
                    "readOnlyHint not true", True, _not_read_only),
        DefaultStep(f"{base}: tool annotations (read-only)", "*", "readOnlyHint: true", False),
    ]


def approval_reason(cfg: Config, server: str, tool: str,
                    annotations: dict[str, Any]) -> str | None:
    """Why a call of `tool` of `server` needs a person's approval, naming the key or the
    annotations that say so; None when it does not: the first of `default_steps` that
    applies decides. By default a tool needs one unless its annotations say
    `readOnlyHint: true` and not `destructiveHint: true`; a pattern in
    `mcp_servers.<server>.approve.always` makes it need one, in `.never` not (`always`
    wins). An unknown server always needs one."""
    for step in default_steps(cfg, server):
        if fnmatchcase(tool, step.tools) and step.applies(annotations):
            return step.source if step.needs_owner else None
    return None


def default_listing(cfg: Config, folder: str) -> list[dict[str, Any]]:
    """The MCP default of group `folder` as `mdclaw approvals rules` lists it: for each
    server its `groups.<g>.mcp` names, the steps of `default_steps`, each with the tools the
    group may call. It holds a call only when no approval rule matched it and people has an
    owner (approvals.rules.rule_for); an empty list otherwise."""
    group = cfg.groups.get(folder)
    if group is None or not group.mcp or not has_owner(cfg):
        return []
    timeout = int(cfg.approvals.timeout.total_seconds())
    out: list[dict[str, Any]] = []
    for server, allowed in sorted(group.mcp.items()):
        if not allowed:
            continue
        for step in default_steps(cfg, server):
            who = "owner" if step.needs_owner else "none"
            tools = f"tool {step.tools}" if step.tools != "*" else "any tool"
            where = f" (of {', '.join(allowed)})" if list(allowed) != ["*"] else ""
            when = f" whose annotations say {step.when}" if step.when else ""
            out.append({
                "source": step.source, "command": None, "action": "mcp_call", "to": None,
                "args": {"server": server, "tool": step.tools}, "approver": who,
                "timeout": timeout, "when": step.when, "default": True,
                "describe": f"{step.source}: action mcp_call, {tools}{where} of {server}"
                            f"{when} -> {'owner' if step.needs_owner else 'nobody'}"
                            " (when no rule matches)"})
    return out


def needs_approval(cfg: Config, server: str, tool: str, annotations: dict[str, Any]) -> bool:
    """Whether a call of `tool` of `server` needs a person's approval (approval_reason)."""
    return approval_reason(cfg, server, tool, annotations) is not None
