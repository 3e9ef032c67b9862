"""Host-side capabilities for agents (web access, ...), each a module registering actions
with `mdclaw/ipc/actions.py`. `load_all()` imports them all, so their actions exist; the
daemon and `mdclaw ipc drain` call it."""

from __future__ import annotations

import importlib

MODULES: tuple[str, ...] = ("web", "home_assistant")


def load_all() -> None:
    """Import every integration module (registering its actions). Idempotent."""
    for name in MODULES:
        importlib.import_module(f"mdclaw.integrations.{name}")
