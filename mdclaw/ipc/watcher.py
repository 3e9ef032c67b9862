"""The IPC loop: inotify wakes it, a slow poll keeps it correct.

inotify (close-after-write and moved-to on every group's command folders) tells the loop
which folders to look at, so a command is applied within a millisecond or two of its rename.
Watches are placed on the folder the engine actually opened (via /proc/self/fd), never on a
path a container could have swapped. The poll (limits.ipc_poll_interval, default 1 s) is the
correctness baseline. Each tick it looks at every group inotify does not cover (no inotify,
a watch that could not be added), at groups whose last look found files still there, and at
a slice of the watched groups, so that every group is looked at within SAFETY_RESCAN
seconds: its cost per tick does not grow with the number of groups while inotify is healthy.
A queue overflow (`IN_Q_OVERFLOW`) makes the next round list every folder at once. A look is
cheap when nothing changed (folders whose mtime did not move are not listed). The snapshots'
fingerprint queries run only when something was committed to the database since the last
tick. Work is taken in fair, bounded batches per group, and the loop yields between batches,
so one group's flood neither starves the others nor blocks the event loop. docs/ipc.md says
how long a lost event can delay a command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import Callable

from inotify_simple import INotify, parse_events
from inotify_simple import flags as F

from mdclaw.config import Config, LiveConfig
from mdclaw.ipc.apply import SETTLE_NS, BackgroundRemover, BatchResult, IpcEngine
from mdclaw.ipc.files import COMMAND_DIRS, is_candidate
from mdclaw.ipc.spool import FileSpooler
from mdclaw.ipc.worker import ActionWorker
from mdclaw.ipc.writers import LOOP_AUTOCHECKPOINT, SnapshotWriter
from mdclaw.state import Database
from mdclaw.state.db import DEFAULT_AUTOCHECKPOINT

log = logging.getLogger("mdclaw.ipc")

DIR_MASK = F.CLOSE_WRITE | F.MOVED_TO | F.DELETE_SELF | F.MOVE_SELF | F.ONLYDIR
LEDGER_PRUNE_EVERY = 3600.0  # seconds
GROUP_MASK = F.CREATE | F.MOVED_TO | F.MOVED_FROM | F.DELETE | F.ONLYDIR
# Every watched group is looked at by the poll at least this often (seconds): the longest a
# command whose inotify event was lost (without an overflow) can wait.
SAFETY_RESCAN = 30.0
# The inotify events the loop reads itself: one read(2) a wake-up (no FIONREAD ioctl and
# poll first, as INotify.read makes), unpacked by inotify_simple.parse_events.
_READ_BYTES = 64 * 1024
_Q_OVERFLOW = int(F.Q_OVERFLOW)
_IGNORED = int(F.IGNORED)
_SELF_GONE = int(F.DELETE_SELF | F.MOVE_SELF)


class IpcWatcher:
    """Runs an IpcEngine until stopped. `use_inotify=False` leaves only the poll."""

    def __init__(self, cfg: Config | LiveConfig, db: Database, *, use_inotify: bool = True,
                 poll_interval: float | None = None, engine: IpcEngine | None = None,
                 safety_rescan: float = SAFETY_RESCAN) -> None:
        # The engine, the spooler and the action worker read the same holder; a reload
        # reaches the poll interval and the watched groups through _config_changed.
        self.live = LiveConfig.of(cfg)
        cfg = self.live.current
        self.engine = engine or IpcEngine(self.live, db, settle_ns=SETTLE_NS)
        # True while run() goes round after round (more was pending after the last round);
        # read by the snapshot thread (_in_a_burst), whose batch of the transcript's index
        # waits for the end of a burst: set before the thread starts.
        self._rounds_on = False
        self.snapshot_writer = SnapshotWriter(cfg.db_path, self.engine.layout,
                                              busy=self._in_a_burst)
        self.engine.snapshots = self.snapshot_writer.request
        self.remover = BackgroundRemover()
        self.engine.remover = self.remover
        # Files agents send are copied on a thread of their own; `on_files_ready` (called
        # from that thread) is how the daemon hears a copy is made.
        self.on_files_ready: Callable[[], None] | None = None
        # Called on every poll tick with whether anything was committed to the database
        # since the last one (by any connection or process).
        self.on_poll: Callable[[bool], None] | None = None
        self.spooler = FileSpooler(self.live, cfg.db_path, on_ready=self._files_ready)
        self.engine.spool = self.spooler.wake
        # Off-loop actions (web, slow work) run on the action worker, a task beside the loop.
        self.actions = ActionWorker(self.live)
        self.engine.on_jobs = self.actions.wake
        self._poll_interval = poll_interval  # given: it wins over the config's
        self._next_poll = 0.0  # time.monotonic() of the next poll tick, while running
        self.safety_rescan = safety_rescan
        self.inotify: INotify | None = None
        if use_inotify:
            try:
                self.inotify = INotify(nonblocking=True)
            except OSError as e:
                log.warning("ipc: inotify unavailable (%s); polling every %.3fs", e,
                            self.poll_interval)
        self._wd: dict[int, tuple[str, str | None]] = {}  # wd -> (folder, sub or None=group)
        self._watched: dict[tuple[str, str | None], tuple[int, int]] = {}  # -> (wd, ino)
        self._dirty: dict[str, set[str]] = {}
        self._names: dict[str, dict[str, set[str]]] = {}  # what inotify reported, by name
        self._resync: set[str] = set()
        self._full_scan = True
        self._wake = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None  # what run() sleeps on, while it does
        self._watch_limit_logged = False
        self._synced_groups: set[str] = set()
        self._fingerprint: tuple[tuple[object, ...], tuple[object, ...]] | None = None
        self._unwatched: set[str] = set()  # groups inotify does not fully cover
        self._recheck: set[str] = set()  # groups the poll looks at again next tick
        self._rotation: list[str] = []  # watched groups, looked at a slice per tick
        self._rotation_at = 0
        self._rotation_of: set[str] | None = None
        self.totals = BatchResult()
        # Decided approvals to carry out (a person answered in this process); the poll
        # tick looks for any other process's decisions and for expiries.
        self._settle_due = True
        self.idle = asyncio.Event()  # set while nothing is known to be pending
        self.last_progress = time.monotonic()
        self._stop: asyncio.Event | None = None  # run()'s, while it runs
        self._failed: BaseException | None = None  # a round run by _on_inotify raised it
        self._reading = False  # _on_inotify is the loop's reader on the inotify fd
        self.live.subscribe(self._config_changed)

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    @property
    def poll_interval(self) -> float:
        """Seconds between two poll ticks (limits.ipc_poll_interval, unless given)."""
        if self._poll_interval is not None:
            return self._poll_interval
        return self.cfg.limits.ipc_poll_interval.total_seconds()

    def _config_changed(self, old: Config, new: Config) -> None:
        """A reload: groups may have come or gone (the reconciler wrote them), and the next
        poll tick is at most the new interval away."""
        self.engine.refresh_groups()
        self.sync_watches()
        self._next_poll = min(self._next_poll, time.monotonic() + self.poll_interval)
        self._ring()

    # ------------------------------------------------------------------ watches
    def _add_watch(self, key: tuple[str, str | None], fd: int, mask: int) -> bool:
        """Watch `fd` under `key`; False if no watch could be added."""
        assert self.inotify is not None
        ino = os.fstat(fd).st_ino
        cur = self._watched.get(key)
        if cur is not None and cur[1] == ino:
            return True
        if cur is not None:
            self._drop_watch(key)
        try:
            wd = self.inotify.add_watch(f"/proc/self/fd/{fd}", mask)
        except OSError as e:
            if not self._watch_limit_logged:
                log.warning("ipc: cannot add inotify watch (%s); the %.3fs poll covers it",
                            e, self.poll_interval)
                self._watch_limit_logged = True
            return False
        self._wd[wd] = key
        self._watched[key] = (wd, ino)
        return True

    def _drop_watch(self, key: tuple[str, str | None]) -> None:
        cur = self._watched.pop(key, None)
        if cur is None:
            return
        self._wd.pop(cur[0], None)
        try:
            assert self.inotify is not None
            self.inotify.rm_watch(cur[0])
        except OSError:
            pass  # already gone with its directory

    def sync_watches(self, folders: set[str] | None = None) -> None:
        """Watch the command folders the engine has open (for `folders`, or all groups)."""
        if self.inotify is None:
            return
        self._synced_groups = set(self.engine.dirs)
        for key in [k for k in self._watched if k[0] not in self.engine.dirs]:
            self._drop_watch(key)
        self._unwatched &= self._synced_groups
        for folder, gd in self.engine.dirs.items():
            if folders is not None and folder not in folders:
                continue
            # Covered: the group's folder is watched (a command folder appearing is seen)
            # and so is every command folder it has.
            covered = True
            for sub in COMMAND_DIRS:
                fd = gd.dir_fd(sub)
                if fd is None:
                    self._drop_watch((folder, sub))
                else:
                    before = self._watched.get((folder, sub))
                    covered = self._add_watch((folder, sub), fd, DIR_MASK) and covered
                    if before is None or self._watched.get((folder, sub)) != before:
                        gd.watched(sub)  # files may have come before this watch, unseen
            if gd.group_fd is not None:
                covered = self._add_watch((folder, None), gd.group_fd, GROUP_MASK) and covered
            else:
                self._drop_watch((folder, None))
                covered = False
            if covered:
                self._unwatched.discard(folder)
            else:
                self._unwatched.add(folder)

    def _in_a_burst(self) -> bool:
        """Whether rounds follow each other now (more was pending after the last one). Read
        by the snapshot thread: one flag of the loop's, read as it stands."""
        return self._rounds_on

    def _on_inotify(self) -> None:
        """The event loop's reader callback on the inotify fd (registered while run()
        sleeps or is about to)."""
        if not self._read_inotify():
            return
        if self._may_work_here():
            self._work_here()
        else:
            self._ring()

    def _read_inotify(self) -> bool:
        """Note what inotify reported since the last read (folders to look at, names that
        arrived). True if anything is to be looked at."""
        assert self.inotify is not None
        try:
            data = os.read(self.inotify.fd, _READ_BYTES)
        except OSError:  # nothing to read (EAGAIN), or the fd is being closed
            return bool(self._dirty or self._resync or self._full_scan)
        for wd, mask, _, name in parse_events(data):
            if mask & _Q_OVERFLOW:
                log.warning("ipc: inotify queue overflowed; scanning every folder")
                self._full_scan = True
                continue
            key = self._wd.get(wd)
            if key is None:
                continue
            folder, sub = key
            if mask & _IGNORED:
                self._watched.pop(key, None)
                self._wd.pop(wd, None)
                self._resync.add(folder)
                self._unwatched.add(folder)  # until the resync watches it again
                continue
            if sub is None:  # the group's IPC folder: a command folder came or went
                if name in COMMAND_DIRS:
                    self._resync.add(folder)
                    self._dirty.setdefault(folder, set()).add(name)
                continue
            if mask & _SELF_GONE:
                self._resync.add(folder)
                continue
            if is_candidate(name):
                self._dirty.setdefault(folder, set()).add(sub)
                self._names.setdefault(folder, {}).setdefault(sub, set()).add(name)
        return bool(self._dirty or self._resync or self._full_scan)

    def _reader(self, loop: asyncio.AbstractEventLoop, on: bool) -> None:
        """Have the event loop call _on_inotify when events come (`on`), or not: while
        run() goes round after round (a burst) it reads the events itself before each
        round, once, instead of a callback in every turn of the loop that brings some (the
        outbox's deliveries turn it thousands of times during a burst)."""
        if self.inotify is None or on == self._reading:
            return
        if on:
            loop.add_reader(self.inotify.fd, self._on_inotify)
        else:
            loop.remove_reader(self.inotify.fd)
        self._reading = on

    def _may_work_here(self) -> bool:
        """Whether the round inotify asks for may run right here, in the reader's callback:
        run() sleeps (nothing else is under way), and nothing but this round is due (no
        settle, no poll tick, no stop, no full scan or resync). A command at a trickle is
        then applied in the turn of the event loop that read its event, without waking
        run() through a future (a turn, its timer and its future more a command)."""
        fut = self._waiter
        stop = self._stop
        return (fut is not None and not fut.done() and stop is not None and not stop.is_set()
                and not self._settle_due and not self._full_scan and not self._resync
                and time.monotonic() < self._next_poll)

    def _work_here(self) -> None:
        """One round from _on_inotify (see _may_work_here): run() is woken only when more
        remains (or the round failed: run() raises it, as if it had run the round)."""
        self.last_progress = time.monotonic()  # the daemon's watchdog reads this
        try:
            busy = self._work_once()
        except BaseException as e:  # noqa: BLE001 - handed to run(), which raises it
            self._failed = e
            self._ring()
            return
        if busy:
            self.idle.clear()
            self._rounds_on = True
            self._ring()

    # ------------------------------------------------------------------ loop
    def _ring(self) -> None:
        """Wake run() from its sleep: it runs in the next turn of the event loop (a plain
        future; waiting on the Event through a task and asyncio.wait took three turns and
        a task per sleep, paid once per command at a trickle)."""
        self._wake.set()
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _sleep(self, timeout: float) -> None:
        """Sleep until _ring() or `timeout` seconds, whichever comes first."""
        if self._wake.is_set():
            return
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def _work_once(self) -> bool:
        """Process one fair batch of what is known to be pending. True if more may remain."""
        if self._resync:
            folders, self._resync = self._resync, set()
            self.sync_watches(folders)
        if self._full_scan:
            self._full_scan = False
            self._names = {}
            pending = self.engine.collect(cheap=False, limit=self.engine.batch_per_group)
        elif self._dirty:
            targets = {f: tuple(sorted(subs)) for f, subs in self._dirty.items()}
            names, self._names = self._names, {}
            self._dirty = {}
            pending = self.engine.collect(targets, names=names,
                                          limit=self.engine.batch_per_group)
        else:
            return False
        batch = self.engine.take_fair(pending)
        if not batch:
            return False
        res = self.engine.process(batch)
        self.totals.add(res)
        if res.deferred:  # files still being written: the poll looks again next tick
            self._recheck.update(batch)
        if set(self.engine.dirs) != self._synced_groups:
            self.sync_watches()
        if not (res.applied or res.rejected or res.finished or res.vanished):
            return False  # only files still being written: the poll comes back for them
        # Whatever was not taken stays dirty; so does every folder just processed that
        # inotify does not cover, since files may have arrived while the batch ran (in a
        # covered one, their events say so), and one whose listing stopped at the limit.
        full = self.engine.batch_per_group
        for folder, files in pending.items():
            taken = len(batch.get(folder, ()))
            if (taken < len(files) or len(files) >= full or self.inotify is None
                    or folder in self._unwatched):
                self._dirty.setdefault(folder, set()).update(sub for _, sub in files)
        return bool(self._dirty or self._resync or self._full_scan)

    def _poll(self) -> None:
        # Changes made outside this loop (scheduler runs, `mdclaw tasks pause`, new chats)
        # show in the snapshots within one poll interval.
        # The fingerprints are computed only if anything was committed since the last tick.
        changed = self.engine.database_changed()
        if changed:
            self.actions.wake()  # jobs another process queued (`mdclaw ipc drain`)
        if self.on_poll is not None:
            # The daemon wakes its sleeping components (scheduler, outbox) from here: one
            # cheap check a tick, not one wake-up each. The action worker is woken above.
            self.on_poll(changed)
        if changed or self._fingerprint is None:
            tasks_fp, groups_fp = self.engine.state_fingerprint()
            if self._fingerprint is not None:
                if tasks_fp != self._fingerprint[0]:
                    self.engine.snapshots(None, tasks=True, groups=False)
                if groups_fp != self._fingerprint[1]:
                    main = self.engine.main_folder()
                    self.engine.snapshots({main} if main else set(), tasks=False, groups=True)
            self._fingerprint = (tasks_fp, groups_fp)
        targets = self.poll_targets()
        pending = self.engine.collect({f: COMMAND_DIRS for f in targets}, cheap=True)
        # A group whose look found files is looked at again next tick, until one finds none.
        self._recheck = set(pending)
        for folder, files in pending.items():
            self._dirty.setdefault(folder, set()).update(sub for _, sub in files)

    def poll_targets(self) -> list[str]:
        """The groups this poll tick looks at: every one without inotify, those to look at
        again, and the next slice of the rest (each within `safety_rescan` seconds)."""
        if self.inotify is None:
            return list(self.engine.dirs)
        if self._rotation_of is not self._synced_groups:  # sync_watches made a new set
            self._rotation_of = self._synced_groups
            self._rotation = sorted(self._synced_groups)
            self._rotation_at = 0
        out = set(self._unwatched) | self._recheck
        n = len(self._rotation)
        if n:
            ticks = max(1.0, self.safety_rescan / max(self.poll_interval, 1e-3))
            share = min(n, -(-n // int(ticks)))  # ceil(n / ticks)
            for i in range(share):
                out.add(self._rotation[(self._rotation_at + i) % n])
            self._rotation_at = (self._rotation_at + share) % n
        return [f for f in out if f in self.engine.dirs]

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set. Start-up writes every snapshot and drains the backlog."""
        loop = asyncio.get_running_loop()
        # The snapshot thread checkpoints the WAL (SnapshotWriter): this connection's own
        # auto-checkpoint is only a backstop while it runs.
        self.engine.db.set_autocheckpoint(LOOP_AUTOCHECKPOINT)
        self.engine.start()
        self.actions.start()
        self.engine.database_changed()
        self._fingerprint = self.engine.state_fingerprint()
        self.sync_watches()
        self._reader(loop, True)
        log.info("ipc: watching %d group(s) (%s, poll every %.3fs)", len(self.engine.dirs),
                 "inotify" if self.inotify is not None else "polling only", self.poll_interval)
        stop_task = asyncio.ensure_future(stop.wait())
        stop_task.add_done_callback(lambda _: self._ring())
        self.remover.call_soon = loop.call_soon
        self._next_poll = time.monotonic() + self.poll_interval
        next_prune = time.monotonic() + LEDGER_PRUNE_EVERY
        self._stop = stop
        try:
            while not stop.is_set():
                if self._failed is not None:
                    failed, self._failed = self._failed, None
                    raise failed
                self.last_progress = time.monotonic()  # the daemon's watchdog reads this
                if self._settle_due:
                    self._settle()
                if not self._reading and self.inotify is not None:
                    self._read_inotify()
                busy = self._work_once()
                if busy:
                    self.idle.clear()
                    self._rounds_on = True
                    self._reader(loop, False)  # read before the next round instead
                    await asyncio.sleep(0)  # let other tasks run
                    continue
                self._reader(loop, True)
                self.idle.set()
                self._rounds_on = False
                now = time.monotonic()
                if now >= self._next_poll:
                    self._poll()
                    self._settle()
                    self._next_poll = now + self.poll_interval
                    if now >= next_prune:
                        self.engine.prune_ledger()
                        next_prune = now + LEDGER_PRUNE_EVERY
                    if self._dirty:
                        continue
                self._wake.clear()
                if not stop.is_set():
                    await self._sleep(max(0.0, self._next_poll - now))
        finally:
            try:
                self.engine.db.set_autocheckpoint(DEFAULT_AUTOCHECKPOINT)
            except sqlite3.Error:
                pass  # closed already: nothing to restore
            self._stop = None
            self._rounds_on = False
            self.remover.call_soon = None
            stop_task.cancel()
            self._reader(loop, False)
            await self.actions.stop()

    def wake_settle(self) -> None:
        """A decision was recorded: carry it out at the loop's next turn (engine.settle)."""
        self._settle_due = True
        self._ring()

    def _settle(self) -> None:
        self._settle_due = False
        try:
            self.engine.settle()
        except sqlite3.Error as e:  # a busy database: the next tick tries again
            log.warning("ipc: could not settle approvals: %s", e)
        except Exception:  # noqa: BLE001 - a bug must not stop the IPC loop; next tick again
            log.exception("ipc: settling approvals failed")

    def _files_ready(self) -> None:
        if self.on_files_ready is not None:
            self.on_files_ready()

    def close(self) -> None:
        self.actions.close()
        self.spooler.close()
        self.remover.close()
        self.engine.remover = None
        self.snapshot_writer.close()
        if self.inotify is not None:
            self.inotify.close()
            self.inotify = None
        self.engine.close()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def run_ipc(cfg: Config, db: Database, stop: asyncio.Event, *,
                  use_inotify: bool = True) -> None:
    """Run the IPC loop for the daemon until `stop` is set."""
    watcher = IpcWatcher(cfg, db, use_inotify=use_inotify)
    try:
        await watcher.run(stop)
    finally:
        watcher.close()
