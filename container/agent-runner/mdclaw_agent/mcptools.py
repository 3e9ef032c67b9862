"""The MCP tools the host offers this group, as ordinary tools of both backends.

The host writes `mcp_tools.json` into the group's IPC folder (the tools `groups.<g>.mcp`
allows, each named `<server>__<tool>` with its description, input schema and annotations,
and how long to wait for it). Each becomes a Tool whose arguments are checked against the
server's schema before anything is written (keywords this check does not know are left to
the host, which checks every call completely), and whose call is an `mcp_call` action
request. The server's answer comes back as text: its text blocks, where images and files it
sent were saved in the group folder, its resources and links.

The file is in a folder the agent can write, so it is only a list of offers: the host
decides every call again (group, server, tool, arguments).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from mdclaw_agent.ipc import read_json_file
from mdclaw_agent.toolbase import Tool, ToolContext, ToolError, request_action

log = logging.getLogger("mdclaw_agent.mcp")

SNAPSHOT = "mcp_tools.json"
ACTION = "mcp_call"
MAX_REPLY = 100_000
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


def _text(result: Any) -> tuple[str, bool]:
    """(text for the model, whether the tool said it failed)."""
    if not isinstance(result, dict):
        return json.dumps(result, ensure_ascii=False), False
    parts: list[str] = []
    for b in result.get("content") or []:
        if not isinstance(b, dict):
            continue
        kind = b.get("type")
        if kind == "text":
            parts.append(str(b.get("text", "")))
        elif kind in ("image", "audio"):
            where = b.get("path") or b.get("error") or "not saved"
            parts.append(f"[{kind} {b.get('mimeType', '')}: {where}]")
        elif kind == "resource":
            head = f"[resource {b.get('uri', '')}"
            if b.get("path"):
                parts.append(f"{head} saved at {b['path']}]")
            else:
                parts.append(f"{head}]\n{b.get('text', '')}")
        elif kind == "resource_link":
            desc = f": {b['description']}" if b.get("description") else ""
            parts.append(f"[link {b.get('uri', '')} {b.get('name', '')}{desc}]")
    if result.get("truncated"):
        parts.append("[cut by the host: the result was longer]")
    text = "\n".join(parts) or "(the tool returned nothing)"
    if len(text) > MAX_REPLY:
        text = text[:MAX_REPLY] + "\n[cut: the result is longer]"
    return text, result.get("isError") is True


def _handler(entry: dict[str, Any]) -> Any:
    server, tool, name = entry["server"], entry["tool"], entry["name"]
    timeout = float(entry.get("timeout") or 75)

    def handler(ctx: ToolContext, args: dict[str, Any]) -> str:
        env = request_action(ctx, {"action": ACTION, "params": {
            "server": server, "tool": tool, "arguments": args}}, timeout=timeout)
        if env.get("status") != "success":
            raise ToolError(f"{name} failed: {env.get('error') or 'no reason given'}")
        text, failed = _text(env.get("result"))
        if failed:
            raise ToolError(f"{name} reported an error: {text}")
        return text
    return handler


def load(ipc_dir: Path) -> list[Tool]:
    """The tools of `ipc_dir/mcp_tools.json`; [] when there is none or it is unreadable."""
    try:
        snap = read_json_file(ipc_dir / SNAPSHOT, limit=8 * 1024 * 1024)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.warning("cannot read %s: %s", SNAPSHOT, e)
        return []
    tools: list[Tool] = []
    seen: set[str] = set()
    entries = snap.get("tools") if isinstance(snap, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and _NAME.match(entry["name"]) and isinstance(entry.get("server"), str)
                and isinstance(entry.get("tool"), str)
                and isinstance(entry.get("inputSchema"), dict)) or entry["name"] in seen:
            continue
        seen.add(entry["name"])
        schema = dict(entry["inputSchema"])
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        desc = entry.get("description") if isinstance(entry.get("description"), str) else ""
        tools.append(Tool(entry["name"], desc or f"{entry['tool']} of {entry['server']}",
                          schema, _handler(entry), action=ACTION, strict_schema=False,
                          tags=("mcp",)))
    return tools


def mcp_tools(ipc_dir: Path, actions: frozenset[str] | None) -> list[Tool]:
    """The MCP tools to offer: none when the host says mcp_call is not this group's."""
    if actions is not None and ACTION not in actions:
        return []
    return load(ipc_dir)
