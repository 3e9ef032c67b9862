"""The `mcp_call` action: an agent calls a tool of an MCP server the host runs (docs/mcp.md).

`{"action": "mcp_call", "params": {"server", "tool", "arguments"}}`. Who may call what is
`groups.<g>.mcp` alone (the action itself is open to every group, like the memory actions:
`groups.<g>.actions` does not gate it); the check runs on the IPC loop before the request is
queued (group, server, tool, the arguments against the tool's JSON Schema) and again when the
worker runs it. `server` and `tool` stay in the params, so approval rules can match them;
when none matches, a tool that is not read-only by its annotations (or that
`mcp_servers.<s>.approve` names) waits for the owner (docs/approvals.md).
The servers run in the daemon (mdclaw.mcp.hub): elsewhere (`mdclaw ipc drain`) a request gets
an error saying so.
"""

from __future__ import annotations

from typing import Any

from mdclaw.config import Config
from mdclaw.ipc.actions import ActionFailed, OffloopContext, action
from mdclaw.ipc.auth import Caller
from mdclaw.mcp.hub import current
from mdclaw.mcp.policy import approval_reason
from mdclaw.mcp.wire import McpError

# The longest a call may take: the largest `mcp_servers.<s>.timeout` (1 h) and some.
CALL_TIMEOUT = 3600.0 + 60.0
NOT_HERE = ("MCP servers run in the daemon (`mdclaw run`); none runs in this process, so "
            "mcp_call cannot be answered here")


def _check(caller: Caller, params: dict[str, Any]) -> None:
    hub = current()
    if hub is None:
        raise ActionFailed(NOT_HERE)
    try:
        hub.authorize(caller.folder, params)
    except McpError as e:
        raise ActionFailed(str(e)) from None


def _needs_person(cfg: Config, caller: Caller, params: dict[str, Any]) -> str | None:
    """When no approval rule matched: a tool that is not read-only waits for the owner
    (mdclaw.mcp.policy.approval_reason; `_check` has passed, so the server and tool are
    known)."""
    hub = current()
    server, tool = params.get("server"), params.get("tool")
    if hub is None or not isinstance(server, str) or not isinstance(tool, str):
        return None  # refused by `_check` already
    return approval_reason(cfg, server, tool, hub.annotations(server, tool))


@action("mcp_call", offloop=True, default_scope="all", max_attempts=1,
        timeout=CALL_TIMEOUT, check=_check, needs_person=_needs_person)
async def mcp_call(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Call the tool; the converted result (mdclaw.mcp.convert). A tool's own error is a
    result with `isError: true`; every other failure an error result saying why."""
    hub = current()
    if hub is None:
        raise ActionFailed(NOT_HERE)
    try:
        return await hub.call(ctx.caller.folder, params)
    except McpError as e:
        raise ActionFailed(f"{params.get('server')}__{params.get('tool')}: {e}") from None
