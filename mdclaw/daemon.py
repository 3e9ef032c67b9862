"""The daemon behind `mdclaw run`: one asyncio loop, systemd notify, clean shutdown.

Start-up: load config, open the database, reconcile, start the services, READY=1.
SIGTERM/SIGINT: STOPPING=1, stop the services, close the database, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import sdnotify

from mdclaw.config import Config
from mdclaw.reconcile import ReconcileError, reconcile
from mdclaw.state import Database

log = logging.getLogger("mdclaw.daemon")


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.notifier = sdnotify.SystemdNotifier()
        self.stop_event = asyncio.Event()
        self.db: Database | None = None

    def notify(self, state: str) -> None:
        self.notifier.notify(state)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_event.set)
        self.db = Database(self.cfg.db_path)
        try:
            plan = reconcile(self.cfg, self.db)
        except ReconcileError as e:
            log.error("reconcile failed: %s", e)
            self.db.close()
            return 1
        log.info("reconciled: %d change(s); %d group(s) configured", len(plan.actions),
                 len(self.cfg.groups))
        self.notify("READY=1")
        self.notify(f"STATUS=serving {len(self.cfg.groups)} group(s)")
        await self.stop_event.wait()
        self.notify("STOPPING=1")
        log.info("stopping")
        self.db.close()
        return 0


def run_daemon(cfg: Config, config_path: str | None = None) -> int:
    """Run until SIGTERM; return the process exit status."""
    return asyncio.run(Daemon(cfg, config_path).run())
