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
        self.ipc_failed = False

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
        ipc_task = self.start_ipc()
        self.notify("READY=1")
        self.notify(f"STATUS=serving {len(self.cfg.groups)} group(s)")
        await self.stop_event.wait()
        self.notify("STOPPING=1")
        log.info("stopping")
        await self.stop_ipc(ipc_task)
        self.db.close()
        return 1 if self.ipc_failed else 0

    # ---------------------------------------------------------------- IPC engine
    def start_ipc(self) -> asyncio.Task[None]:
        """Run the IPC loop (mdclaw.ipc.watcher) until stop_event; if it dies, stop too."""
        from mdclaw.ipc.watcher import run_ipc

        assert self.db is not None
        task = asyncio.create_task(run_ipc(self.cfg, self.db, self.stop_event), name="ipc")

        def _done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("IPC loop failed: %r", t.exception())
                self.ipc_failed = True
                self.stop_event.set()

        task.add_done_callback(_done)
        return task

    async def stop_ipc(self, task: asyncio.Task[None]) -> None:
        """Wait for the IPC loop to finish its current batch and close."""
        try:
            await asyncio.wait_for(task, timeout=30)
        except Exception:  # already logged by the done callback, or a timeout
            task.cancel()


def run_daemon(cfg: Config, config_path: str | None = None) -> int:
    """Run until SIGTERM; return the process exit status."""
    return asyncio.run(Daemon(cfg, config_path).run())
