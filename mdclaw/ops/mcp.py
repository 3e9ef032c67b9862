"""What `mdclaw mcp list|tools|call` and `doctor` do with the MCP servers: the same hub, the
same rules as the daemon (mdclaw.mcp), run in the command's own process for the servers it
needs, and stopped when it is done."""

from __future__ import annotations

import asyncio
from typing import Any

from mdclaw.config import Config
from mdclaw.mcp import policy
from mdclaw.mcp.hub import McpHub
from mdclaw.ops.status import gather_status
from mdclaw.retry import Backoff


def server_rows(cfg: Config) -> list[dict[str, Any]]:
    """Each configured server (kind, what it runs or reaches, timeout, who may use it), with
    the running daemon's view of it when the daemon publishes one."""
    published = gather_status(cfg).get("mcp") or []
    live: dict[str, dict[str, Any]] = {s["server"]: s for s in published
                                       if isinstance(s, dict) and "server" in s}
    rows = []
    for name, spec in cfg.mcp_servers.items():
        target = (" ".join([spec.command, *spec.args]) if spec.command else
                  spec.url if spec.url else str(spec.socket))
        groups = [f for f, g in cfg.groups.items() if g.mcp and name in g.mcp]
        now = live.get(name, {})
        rows.append({"server": name, "kind": spec.kind, "runs": target,
                     "timeout": spec.timeout.total_seconds(), "groups": ", ".join(groups),
                     "state": now.get("state", "-"), "detail": now.get("detail", ""),
                     "tools": now.get("tools", "-"), "restarts": now.get("restarts", "-")})
    return rows


async def _with_hub(cfg: Config, names: list[str], fn: Any) -> Any:
    # One try each: a command reports what it found, it does not wait out a backoff.
    names = [n for n in names if n in cfg.mcp_servers]
    hub = McpHub(cfg, snapshots=False, backoff=Backoff(base=3600.0, jitter=0))
    await hub.start(only=names)
    try:
        timeout = max((cfg.mcp_servers[n].start_timeout.total_seconds() for n in names),
                      default=0.0)
        await hub.wait_settled(timeout + 1)
        return await fn(hub)
    finally:
        await hub.stop()


def tool_rows(cfg: Config, servers: list[str], group: str | None) -> list[dict[str, Any]]:
    """Start `servers` here, list their tools: the name agents see, whether a call needs
    approval, and (with `group`) only what that group may call. A server that does not start
    is one row saying why; a tool not offered, one row saying why not."""
    async def look(hub: McpHub) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for st in hub.servers.values():
            if st.tools is None:
                rows.append({"server": st.name, "tool": "-", "name": "-",
                             "needs_approval": "-", "description": f"{st.state}: {st.detail}"})
                continue
            tools = st.tools if group is None else [
                t for t in policy.allowed_tools(cfg, group, {st.name: st.tools})]
            for t in tools:
                rows.append({"server": st.name, "tool": t.name, "name": t.offered,
                             "needs_approval": policy.needs_approval(cfg, st.name, t.name,
                                                                     t.annotations),
                             "description": t.description.split("\n")[0][:100]})
            if group is None:
                rows += [{"server": st.name, "tool": "-", "name": "-", "needs_approval": "-",
                          "description": f"not offered: {p}"} for p in st.problems]
        return rows
    return asyncio.run(_with_hub(cfg, servers, look))


def call(cfg: Config, group: str, server: str, tool: str,
         arguments: dict[str, Any]) -> dict[str, Any]:
    """Call `tool` of `server` as group `group` would (the same rules, caps and timeout);
    the converted result. Raises mdclaw.mcp.wire.McpError."""
    async def run(hub: McpHub) -> dict[str, Any]:
        return await hub.call(group, {"server": server, "tool": tool,
                                      "arguments": arguments}, who="cli")
    result: dict[str, Any] = asyncio.run(_with_hub(cfg, [server], run))
    return result


def doctor_rows(cfg: Config) -> list[tuple[str, str, str, str]]:
    """(check, level, detail, fix) for each server: started here and its tools listed."""
    if not cfg.mcp_servers:
        return []

    async def look(hub: McpHub) -> list[tuple[str, str, str, str]]:
        out = []
        for st in hub.servers.values():
            name = f"mcp {st.name}"
            if st.tools is None:
                fix = {"stdio": f"check mcp_servers.{st.name}.command and its args (run it "
                                "by hand: it must speak MCP on stdin/stdout)",
                       "http": f"start the server, or fix mcp_servers.{st.name}.url",
                       "socket": f"start the server's socket unit, or fix "
                                 f"mcp_servers.{st.name}.socket"}[st.spec.kind]
                out.append((name, "fail", f"does not start: {st.detail}", fix))
                continue
            names = ", ".join(t.offered for t in st.tools[:8])
            more = f" and {len(st.tools) - 8} more" if len(st.tools) > 8 else ""
            out.append((name, "ok", f"up: {len(st.tools)} tool(s): {names}{more}", ""))
            if st.problems:
                out.append((name, "warn", "not offered: " + "; ".join(st.problems)[:300],
                            "ask the server's author, or leave those tools unused"))
        return out
    return asyncio.run(_with_hub(cfg, list(cfg.mcp_servers), look))
