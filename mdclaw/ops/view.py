"""`DaemonView`: what the operator page and /metrics (mdclaw.operator) may see of the running
daemon, and nothing else. mdclaw.daemon.core.Daemon satisfies it; mypy checks that where the
daemon mounts them (a Daemon is passed where a DaemonView is expected), so a member the page
uses and the daemon lacks fails the type check, not a page view at run time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mdclaw.channels.base import Channel
from mdclaw.config import Config
from mdclaw.mcp.hub import McpHub
from mdclaw.queue import GroupQueue
from mdclaw.state import Database


class DaemonView(Protocol):
    @property
    def cfg(self) -> Config:
        """The running config (the one a reload applied last)."""

    @property
    def config_path(self) -> str | None:
        """--config as given (None: the default search)."""

    @property
    def db(self) -> Database:
        """The state database, open while the daemon runs."""

    @property
    def channels(self) -> Sequence[Channel]:
        """The channels the config enables (connected or not)."""

    @property
    def queue(self) -> GroupQueue | None:
        """The container run queue (None before it exists)."""

    @property
    def mcp(self) -> McpHub | None:
        """The MCP servers the daemon runs (None before they are started)."""

    @property
    def last_reload(self) -> dict[str, Any] | None:
        """The last SIGHUP reload: {"at", "ok", "changes" or "error"}; None before one."""

    @property
    def reload_error(self) -> str | None:
        """Why the last reload failed (None: it did not)."""

    def status(self) -> dict[str, Any]:
        """The status the daemon publishes (mdclaw.ops.status reads the published copy)."""

    def status_line(self, s: dict[str, Any] | None = None) -> str:
        """The one-line summary of `s` (the status now when not given)."""

    def wake_scheduler(self) -> None:
        """Look at the tasks again now (a task was changed)."""

    def wake_outbox(self) -> None:
        """Look at the outbox again now (a row is to be sent again)."""

    def wake_approvals(self) -> None:
        """Carry out a decision recorded now (an approval the operator decided)."""

    def disk_blocked(self, folder: str) -> bool:
        """Whether the group is refused runs for its disk use (mdclaw.diskguard)."""

    async def tokens_today(self, folder: str) -> int:
        """Model tokens the group used today (UTC), as its budget counts them."""
