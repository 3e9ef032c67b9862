"""Host-side capabilities for agents (web access, Home Assistant, MCP tools...), each a module
registering actions with `mdclaw/ipc/actions.py` when it is imported. This package imports
them all, so whoever imports it (the daemon, the runner, `mdclaw ipc drain`) has their actions;
`load_all()` says so where they are needed."""

from __future__ import annotations

from types import ModuleType

from mdclaw.integrations import agents, home_assistant, mcp, web

MODULES: tuple[ModuleType, ...] = (web, home_assistant, mcp, agents)


def load_all() -> tuple[ModuleType, ...]:
    """The integration modules, their actions registered (they came with this package)."""
    return MODULES
