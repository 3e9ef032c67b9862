"""The daemon behind `mdclaw run`: one asyncio loop, systemd notify, reload and drain.

Start-up: open the database, reconcile, read the web server's token, start the IPC loop, the
scheduler, the outbox worker, the web server (mdclaw.daemon.web: the local HTTP chat's routes,
the operator page, /metrics), the channels and the container runner (an engine that is down
is retried with backoff and shown in STATUS=, not a crash loop), then READY=1.

SIGHUP: RELOADING=1, re-read and validate the config and its secret files, reconcile, make it
the config in force (mdclaw.config.live: every component reads it at use time, those that
must act on a change subscribe), READY=1. An invalid config or a bad secret file keeps the old
one running and says why; a changed restart-only key (RESTART_ONLY) keeps its running value
and the log says to restart.

SIGTERM/SIGINT: STOPPING=1, stop taking work, write `_close` to running conversations, wait
up to `drain_timeout` (30 s) for runs to finish, stop the rest, flush the outbox state, close
the database, log "stopped (exit 0)" as the last line, exit 0. A second SIGTERM exits at
once with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sqlite3
import time
from typing import Any

from aiohttp import web

from mdclaw.channels.base import Channel
from mdclaw.channels.http import HttpChannel
from mdclaw.channels.registry import apply_config as apply_channel_config
from mdclaw.channels.registry import build_channels, connect_all, disconnect_all
from mdclaw.config import (
    Config,
    ConfigError,
    LiveConfig,
    check_secret_files,
    load_config,
    old_server_key_warnings,
    reload_config,
)
from mdclaw.daemon.web import WebServerSetupError, build_web_server, server_gate
from mdclaw.decisions import Decider
from mdclaw.diskguard import DiskGuard
from mdclaw.integrations import agents as agent_asks
from mdclaw.integrations import load_all
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.mcp import hub as mcp_hub
from mdclaw.mcp.hub import McpHub
from mdclaw.operator import mount_operator
from mdclaw.operator.metrics import mount_metrics, start_listener
from mdclaw.ops.health import channel_states
from mdclaw.ops.status import status_path
from mdclaw.ops.view import DaemonView
from mdclaw.orchestrator import Orchestrator
from mdclaw.outbox import OutboxWorker, service_replier, spool_cleaner
from mdclaw.paths import Layout
from mdclaw.proxy import CredentialProxy
from mdclaw.queue import GroupQueue
from mdclaw.reconcile import ReconcileError, reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.runtime import ContainerRuntime, create_runtime, engine_errors, wait_for_engine
from mdclaw.schedule import to_iso, utc_now
from mdclaw.scheduler import DAEMON_MAX_SLEEP, Scheduler
from mdclaw.state import Database, now_iso
from mdclaw.state.outbox import recent_outbox_counts
from mdclaw.systemd import Notifier
from mdclaw.usage import tokens_on_day
from mdclaw.webserver import TokenGate, WebServer

log = logging.getLogger("mdclaw.daemon")

DRAIN_TIMEOUT = 30.0
CLOCK_JUMP = 0.5  # seconds the wall clock may drift against the monotonic one between polls


class Daemon:
    def __init__(self, cfg: Config, config_path: str | None = None, *,
                 drain_timeout: float = DRAIN_TIMEOUT) -> None:
        # The config in force: every component is given this holder and reads it at use time.
        self.live = LiveConfig(cfg)
        self.config_path = config_path
        self.drain_timeout = drain_timeout
        self.notifier = Notifier()
        self.stop_event = asyncio.Event()
        # The IPC loop outlives the drain: agents still write their last replies.
        self.ipc_stop = asyncio.Event()
        self._db: Database | None = None  # open while run() runs
        self.failed: list[str] = []
        self.engine_status = "checking"
        self.reload_error: str | None = None
        # The last SIGHUP reload: {"at", "ok", "changes" or "error"}; None before the first.
        self.last_reload: dict[str, Any] | None = None
        self.started_at = to_iso(utc_now())
        self._tasks: list[asyncio.Task[Any]] = []
        self._sigterms = 0
        self._reloading = asyncio.Lock()
        self.watcher: IpcWatcher | None = None
        self.scheduler: Scheduler | None = None
        self.outbox: OutboxWorker | None = None
        self.channels: list[Channel] = []
        self.runtime: ContainerRuntime | None = None
        self.runner: ContainerRunner | None = None
        self.proxy: CredentialProxy | None = None
        self.orch: Orchestrator | None = None
        self.decider: Decider | None = None
        self.diskguard: DiskGuard | None = None
        # The web server (server:) and its token, which the metrics.listen listener shares.
        self.gate = TokenGate(None)
        self.web: WebServer | None = None
        self.metrics_runner: web.AppRunner | None = None  # the metrics.listen listener
        self.mcp: McpHub | None = None  # the MCP servers the host runs for agents
        self._clock_offset = time.time() - time.monotonic()

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    # ---------------------------------------------------------------- signals
    def _on_sigterm(self) -> None:
        self._sigterms += 1
        if self._sigterms > 1:
            log.error("second stop signal: exiting at once")
            logging.shutdown()
            os._exit(1)
        self.stop_event.set()

    def _on_sighup(self) -> None:
        asyncio.get_running_loop().create_task(self.reload(), name="reload")

    # ---------------------------------------------------------------- run
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_sigterm)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        for warning in old_server_key_warnings(self.cfg):
            log.warning("config: %s", warning)
        self._db = db = Database(self.cfg.db_path)
        try:
            plan = reconcile(self.cfg, db)
        except ReconcileError as e:
            log.error("reconcile failed: %s", e)
            db.close()
            return 1
        log.info("reconciled: %d change(s); %d group(s) configured", len(plan.actions),
                 len(self.cfg.groups))
        for warning in plan.warnings:
            log.warning("reconcile: %s", warning)
        try:
            self.gate = server_gate(self.cfg)
        except WebServerSetupError as e:
            log.error("%s", e)
            db.close()
            return 1
        try:
            await self.start_services()
            self.notifier.ready(self.status_line())
            log.info("ready: %s", self.status_line())
            await self.stop_event.wait()
        finally:
            self.notifier.stopping()
            log.info("stopping: draining for up to %.0f s", self.drain_timeout)
            await self.stop_services()
            db.close()
            # the last line: whoever watches the log (make run, journalctl) knows it is over
            log.info("stopped%s", f" after {', '.join(self.failed)} failed (exit 1)"
                     if self.failed else " (exit 0)")
        return 1 if self.failed else 0

    def _watch(self, task: asyncio.Task[Any], name: str) -> asyncio.Task[Any]:
        """Keep `task`; if it dies with an error, the daemon stops (systemd restarts it)."""
        def _done(t: asyncio.Task[Any]) -> None:
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %r", name, t.exception())
                self.failed.append(name)
                self.stop_event.set()

        task.add_done_callback(_done)
        self._tasks.append(task)
        return task

    async def start_services(self) -> None:
        cfg, db, live = self.cfg, self.db, self.live
        load_all()  # host actions of the integrations (web...) register themselves
        # Containers: the runtime is lazy; the engine is waited for in the background.
        try:
            self.runtime = create_runtime(cfg.runtime)
            self.runner = ContainerRunner(live, self.runtime)
        except engine_errors() as e:  # the daemon runs on; runs say there is no engine
            self.engine_status = f"no container engine: {e}"
            log.error("%s", self.engine_status)
        self.proxy = CredentialProxy(Layout(cfg.data_dir), db)
        # MCP servers: started here (never in a container), each restarted with backoff;
        # the mcp_call action reaches them through the installed hub.
        self.mcp = McpHub(live)
        mcp_hub.install(self.mcp)
        await self.mcp.start()
        clean = spool_cleaner(cfg.data_dir / "spool" / "outbox")
        # Failed deliveries are retried by the limits.delivery_* in force.
        self.outbox = outbox = OutboxWorker(db, cfg=live, on_sent=clean, on_failed=clean)
        # Disk limits: groups past theirs are stopped and refused (mdclaw.diskguard).
        self.diskguard = DiskGuard(live, self.runner)
        self.orch = orch = Orchestrator(live, db, runner=self.runner, proxy=self.proxy,
                                        wake_outbox=outbox.wake, diskguard=self.diskguard)
        # ask_agent reaches other groups' agents through the orchestrator's port.
        agent_asks.install(orch.asks)
        # IPC: applied commands wake the outbox and the scheduler at once.
        self.watcher = IpcWatcher(live, db)
        self.watcher.engine.on_commit = self._after_ipc_commit
        self.watcher.engine.outbox = outbox  # messages to idle chats go to it directly
        # People's decisions (buttons, reply codes, admit cards): the IPC loop carries them
        # out (engine.settle), the action worker runs or refuses what they released.
        self.decider = Decider(live, db, decided=self.wake_approvals)
        orch.decider = self.decider
        self.watcher.engine.on_settled = self._after_settle
        # A held request's outcome note goes to the chat its agent was answering in.
        self.watcher.engine.answering = orch.answering
        loop = asyncio.get_running_loop()

        def files_ready() -> None:  # from the watcher's thread
            loop.call_soon_threadsafe(outbox.wake)

        self.watcher.on_files_ready = files_ready
        self.watcher.on_poll = self._after_ipc_poll
        self._watch(asyncio.create_task(self.watcher.run(self.ipc_stop), name="ipc"), "ipc")
        self.notifier.add_probe("ipc", self._ipc_progress)
        # Scheduler: due tasks go through the orchestrator's queue.
        # It sleeps until the next due time: _after_ipc_poll wakes it on any commit.
        self.scheduler = Scheduler(db, self.orch.execute_task,
                                   default_timezone=lambda: self.cfg.assistant.timezone,
                                   max_sleep=DAEMON_MAX_SLEEP)
        self._watch(asyncio.create_task(self.scheduler.run(), name="scheduler"), "scheduler")
        self.notifier.add_probe("scheduler", self._scheduler_progress)
        # The web server: the local HTTP chat adds its routes as it is built, then the
        # operator page and /metrics join; it listens before the channels connect.
        self.web = build_web_server(cfg, self.gate)
        # Channels and delivery.
        self.channels = build_channels(cfg, db, self.web, on_inbound=self.orch.on_inbound)
        # A channel's own answers (/chatid) go through the outbox like any reply; presses of
        # cards' buttons are people's decisions.
        for ch in self.channels:
            ch.on_service_reply(service_replier(db, self.outbox.wake))
            ch.on_press(self.decider.on_press)
            if isinstance(ch, HttpChannel):  # a person's retry of a failed reply wakes it
                ch.wake_outbox = self.outbox.wake
        self.orch.channels = self.channels
        self.outbox.set_channels(self.channels)
        # A reload reaches the parts wired here (the rest read `live` themselves).
        live.subscribe(self._config_changed)
        await self._start_web(self)
        await self.outbox.start()
        problems = await connect_all(self.channels)
        for name, reason in problems.items():
            log.error("channel %s is down: %s", name, reason)
        if self.runtime is not None and self.runner is not None:
            self._watch(asyncio.create_task(
                self._engine_up(self.runtime, self.runner, orch), name="engine"), "engine")
        self._watch(asyncio.create_task(self.notifier.watchdog_loop(), name="watchdog"),
                    "watchdog")
        self._watch(asyncio.create_task(self._status_loop(), name="status"), "status")
        self._watch(asyncio.create_task(self.diskguard.run(self.stop_event), name="disk"),
                    "disk")

    async def _start_web(self, view: DaemonView) -> None:
        """The operator page and `/metrics` on the web server (mdclaw.operator), which then
        listens; `/metrics` also on `metrics.listen`. `view` is this daemon as the page sees
        it (passing `self` makes mypy check that the Daemon is a DaemonView). A listener that
        cannot bind is logged, not fatal: the daemon runs on without it."""
        if self.web is not None:
            access = mount_operator(self.web, view)
            mount_metrics(self.web, view, access)
            try:
                await self.web.start()
            except OSError as e:
                log.error("web server: %s; the operator page, /metrics and the local HTTP "
                          "chat are not served (server.listen)", e)
        try:
            self.metrics_runner = await start_listener(view, self.gate)
        except OSError as e:
            log.error("metrics: cannot listen on %s: %s", self.cfg.metrics.listen,
                      e.strerror or e)

    # ---------------------------------------------------------------- the operator's view
    @property
    def db(self) -> Database:
        """The state database, open while the daemon runs."""
        assert self._db is not None, "the database is open only while the daemon runs"
        return self._db

    @property
    def queue(self) -> GroupQueue | None:
        return self.orch.queue if self.orch is not None else None

    def wake_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.wake()

    def wake_outbox(self) -> None:
        if self.outbox is not None:
            self.outbox.wake()

    def wake_approvals(self) -> None:
        """A decision was recorded (here, or by the operator page): carry it out now."""
        if self.watcher is not None:
            self.watcher.wake_settle()
            self.watcher.actions.wake()
        if self.outbox is not None:
            self.outbox.wake()

    def _after_settle(self, settled: list[Any]) -> None:
        """Decided approvals were carried out: an admitted sender's message may run, cards
        are to be edited."""
        if self.orch is not None:
            for a in settled:
                if a.kind == "admission" and a.status == "approved":
                    self.orch.poke(a.group_folder)
        if self.outbox is not None:
            self.outbox.wake()

    def disk_blocked(self, folder: str) -> bool:
        return self.diskguard is not None and self.diskguard.blocked(folder) is not None

    async def tokens_today(self, folder: str) -> int:
        """As the credential proxy counts them (in memory, ahead of its flush), else as the
        database has them."""
        if self.proxy is not None:
            return await self.proxy.ledger.tokens_today(folder)
        return await asyncio.to_thread(tokens_on_day, self.db, folder, now_iso()[:10])

    def _after_ipc_commit(self, items: list[Any]) -> None:
        # A batch whose every file was a message or reaction handed to the outbox worker
        # (Item.direct) needs no look of the worker's; one of messages and reactions alone
        # changed no task: the scheduler sleeps on (it is woken for anything else).
        if self.outbox is not None and not all(it.direct is not None for it in items):
            self.outbox.wake()
        if self.scheduler is not None and not all(
                it.outcome == "applied" and it.ctype in ("message", "react") for it in items):
            self.scheduler.wake()

    def _after_ipc_poll(self, db_changed: bool) -> None:
        """Each IPC poll tick (limits.ipc_poll_interval): what another process committed
        (`mdclaw tasks add`, an outbox retry) or a wall-clock jump wakes the components that
        sleep until their next deadline, as their own 1 s polls did (the watcher wakes its
        action worker itself)."""
        offset = time.time() - time.monotonic()
        before = self._clock_offset
        jumped = abs(offset - before) > CLOCK_JUMP
        self._clock_offset = offset
        if jumped and self.scheduler is not None:
            log.info("the wall clock moved by %.1f s: the scheduler looks again",
                     offset - before)
            self.scheduler.wake()
        if not db_changed:
            return
        if self.scheduler is not None:
            self.scheduler.wake()
        if self.outbox is not None:
            self.outbox.wake()

    def _ipc_progress(self) -> float:
        # The IPC loop goes round at least once per poll interval.
        assert self.watcher is not None
        return self.watcher.last_progress

    def _scheduler_progress(self) -> float:
        # Asleep until its next due time counts as progress; late or stuck does not.
        assert self.scheduler is not None
        return self.scheduler.alive_at()

    async def _engine_up(self, runtime: ContainerRuntime, runner: ContainerRunner,
                         orch: Orchestrator) -> None:
        def status(line: str) -> None:
            self.engine_status = line
            self._publish()

        desc = await wait_for_engine(runtime, status=status, stop=self.stop_event)
        if desc is None:
            return
        try:
            await runner.cleanup_orphans()
        except engine_errors() as e:  # the engine went away again: runs will say so
            log.warning("could not remove orphaned containers: %s", e)
        self.engine_status = f"ok ({desc})"
        orch.engine_ready.set()
        orch.recover_pending()
        self._publish()
        log.info("container engine: %s", desc)

    # ---------------------------------------------------------------- status
    def status(self) -> dict[str, Any]:
        nxt = self.scheduler.next_wakeup() if self.scheduler else None
        connected = {ch.name: ch.is_connected() for ch in self.channels}
        details = channel_details(self.channels)
        return {
            "pid": os.getpid(), "started_at": self.started_at, "updated_at": to_iso(utc_now()),
            "groups": int(self.db.scalar("SELECT count(*) FROM registered_groups")),
            "engine": self.engine_status,
            "containers": self.orch.queue.running_groups() if self.orch else [],
            "queue": self.orch.queue.status() if self.orch else {},
            "outbox": recent_outbox_counts(self.db),
            "next_task": to_iso(nxt) if nxt else None,
            "channels": connected,
            # connected, deliveries failing, needs attention or not connected: the one rule
            # (ops.health)
            "channel_states": {n: v["state"] for n, v in channel_states(
                self.db, connected, {ch.name: ch.jid_prefix for ch in self.channels},
                {n: d["fix"] for n, d in details.items() if d.get("fix")}).items()},
            "channel_details": details,
            "reload_error": self.reload_error,
            "timings": self.orch.timings[-10:] if self.orch else [],
            "disk": self.diskguard.status() if self.diskguard else None,
            "mcp": [{"server": s["server"], "state": s["state"], "detail": s["detail"],
                     "tools": len(s["tools"]), "restarts": s["restarts"]}
                    for s in self.mcp.status()] if self.mcp else [],
        }

    def status_line(self, s: dict[str, Any] | None = None) -> str:
        """The one-line summary of `s` (the status now when not given)."""
        s = s if s is not None else self.status()
        line = (f"{s['groups']} group(s), {len(s['containers'])} container(s) running, "
                f"{s['queue'].get('pending', 0)} queued, outbox {s['outbox']['pending']} "
                f"pending/{s['outbox']['failed']} failed, next task {s['next_task'] or '-'}")
        if not s["engine"].startswith("ok"):
            line += f"; engine: {s['engine']}"
        if self.reload_error:
            line += f"; last reload failed: {self.reload_error}"
        blocked = (s.get("disk") or {}).get("blocked") or {}
        if blocked:
            line += "; disk: " + ", ".join(f"{f} refused ({v['state']})"
                                           for f, v in blocked.items())
        return line

    def write_status(self, s: dict[str, Any] | None = None) -> None:
        path = status_path(self.cfg)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(s if s is not None else self.status(), indent=2))
        os.chmod(tmp, 0o640)
        os.replace(tmp, path)

    def _publish(self) -> None:
        try:
            s = self.status()  # gathered once for the file and the STATUS= line
            self.write_status(s)
            self.notifier.status(self.status_line(s))
        except (OSError, sqlite3.Error) as e:  # a full disk, a busy database: not fatal
            log.warning("could not write status: %s", e)

    async def _status_loop(self) -> None:
        while not self.stop_event.is_set():
            self._publish()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), 5)

    # ---------------------------------------------------------------- reload
    async def reload(self) -> bool:
        """Re-read the config; apply it if valid, keep the old one otherwise."""
        async with self._reloading:
            self.notifier.reloading()
            log.info("reloading config")
            try:
                new = await asyncio.to_thread(load_config, self.config_path)
                await asyncio.to_thread(check_secret_files, new, self.config_path)
                plan = await asyncio.to_thread(reconcile, new, self.db)
            except ConfigError as e:
                error: str | None = "; ".join(i.render(e.file) for i in e.issues)[:500]
                log.error("reload: invalid config, keeping the running one: %s", error)
            except ReconcileError as e:
                error = str(e)[:500]
                log.error("reload: cannot apply config, keeping the running one: %s", e)
            else:
                error = None
                self.apply_config(new)
                log.info("reloaded: %d change(s)", len(plan.actions))
                for warning in plan.warnings:
                    log.warning("reconcile: %s", warning)
            self.reload_error = error
            self.last_reload = ({"at": to_iso(utc_now()), "ok": True,
                                 "changes": [a.describe() for a in plan.actions]}
                                if error is None else
                                {"at": to_iso(utc_now()), "ok": False, "error": error})
            self._publish()
            self.notifier.ready(self.status_line())
            return error is None

    def apply_config(self, new: Config) -> None:
        """Make `new` the config in force: every component reads it from now on (those that
        must act on a change are told by the holder); restart-only keys keep their running
        values, each change logged with "restart mdclaw to apply it"."""
        old = self.cfg
        new, _restart = reload_config(old, new)
        if new.log_level != old.log_level:
            apply_log_level(new.log_level)
            log.warning("reload: log_level is now %s", new.log_level)
        self.live.replace(new)

    def _config_changed(self, old: Config, new: Config) -> None:
        """What the daemon itself wires follows a reload: the caps of the groups the proxy
        serves now, what the channels take from outside their section, and the scheduler
        (tasks and their time zones may have changed) looks again."""
        if self.proxy is not None:
            self.proxy.apply_caps(new)
        apply_channel_config(self.channels, new)
        if self.scheduler is not None:
            self.scheduler.wake()

    # ---------------------------------------------------------------- stop
    async def stop_services(self) -> None:
        if self.orch is not None:
            self.orch.accepting = False
            closed = self.orch.close_conversations()
            if closed:
                log.info("asked %d running conversation(s) to finish", closed)
        # Stop claiming tasks and taking jobs; runs in progress get drain_timeout to finish
        # (a scheduled run cut short is recorded as interrupted).
        async def drain_queue() -> None:
            if self.orch is None:
                return
            left = await self.orch.queue.shutdown(grace=self.drain_timeout)
            self.orch.abandon(left)
            if left:
                log.warning("%d queued job(s) not run; their messages stay in the database "
                            "and are picked up at the next start", len(left))

        waits: list[Any] = [drain_queue()]
        if self.scheduler is not None:
            waits.append(self.scheduler.stop(timeout=self.drain_timeout))
        await asyncio.gather(*waits, return_exceptions=True)
        self.ipc_stop.set()
        if self.outbox is not None:
            await self.outbox.stop()  # before the channels go, so a send under way finishes
        await disconnect_all(self.channels)
        if self.web is not None:
            await self.web.stop()
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.mcp is not None:  # after the action worker: no call is left to answer
            await self.mcp.stop()
            mcp_hub.install(None)
        agent_asks.install(None)
        if self.watcher is not None:
            self.watcher.close()
        if self.proxy is not None:
            await self.proxy.close()
        if self.runner is not None:
            await self.runner.aclose()
        with contextlib.suppress(OSError):
            status_path(self.cfg).unlink()


def channel_details(channels: list[Channel]) -> dict[str, dict[str, str]]:
    """What each channel says of its state beyond up/down (`detail`, and the `fix` while
    something is wrong), for `mdclaw status`."""
    out = {}
    for ch in channels:
        info = ch.status_info()
        kept = {k: info[k] for k in ("detail", "fix") if isinstance(info.get(k), str)}
        if kept:
            out[ch.name] = kept
    return out


def apply_log_level(level: str) -> None:
    """Make `log_level` from the config the root logger's level."""
    root = logging.getLogger()
    new = getattr(logging, level.upper(), logging.INFO)
    if root.level != new:
        root.setLevel(new)


def run_daemon(cfg: Config, config_path: str | None = None) -> int:
    """Run until SIGTERM; return the process exit status."""
    apply_log_level(cfg.log_level)
    return asyncio.run(Daemon(cfg, config_path).run())
