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
from mdclaw.scheduler import Execute, Scheduler
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
        self.scheduler: Scheduler | None = None
        self.scheduler_failed = False
        # The async callable that runs a due task; the container queue plugs in here.
        self.task_executor: Execute | None = None

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
        scheduler_task = self.start_scheduler()
        self.notify("READY=1")
        self.notify(f"STATUS=serving {len(self.cfg.groups)} group(s)")
        await self.stop_event.wait()
        self.notify("STOPPING=1")
        log.info("stopping")
        await self.stop_ipc(ipc_task)
        await self.stop_scheduler(scheduler_task)
        self.db.close()
        return 1 if self.ipc_failed or self.scheduler_failed else 0

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

    # ---------------------------------------------------------------- scheduler
    def start_scheduler(self) -> asyncio.Task[None]:
        """Run the task scheduler (mdclaw.scheduler) until stopped; if it dies, stop too.

        Code that changes the task table calls `self.scheduler.wake()` afterwards.
        """
        assert self.db is not None
        self.scheduler = Scheduler(self.db, self.task_executor or no_runner,
                                   default_timezone=self.cfg.assistant.timezone)
        task = asyncio.create_task(self.scheduler.run(), name="scheduler")

        def _done(t: asyncio.Task[None]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("scheduler failed: %r", t.exception())
                self.scheduler_failed = True
                self.stop_event.set()

        task.add_done_callback(_done)
        return task

    async def stop_scheduler(self, task: asyncio.Task[None]) -> None:
        """Stop claiming; give runs in progress 10 s, then record them as interrupted."""
        assert self.scheduler is not None
        await self.scheduler.stop(timeout=10)
        try:
            await asyncio.wait_for(task, timeout=10)
        except Exception:  # already logged by the done callback, or a timeout
            task.cancel()


async def no_runner(task) -> None:  # noqa: ANN001 - TaskRow
    """The executor until a container runner is wired in: the run is recorded as an error."""
    log.warning("task %s is due but no container runner is configured; not run", task.id)
    raise RuntimeError("no container runner is configured; the task was not run")


def run_daemon(cfg: Config, config_path: str | None = None) -> int:
    """Run until SIGTERM; return the process exit status."""
    return asyncio.run(Daemon(cfg, config_path).run())
