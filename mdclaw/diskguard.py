"""Disk limits: one group cannot fill its folder without end, and no container fills the disk.

Two rules, one definition (the daemon, `mdclaw status` and `mdclaw doctor` all use `check`):

* **a group's files** — what its container can write: `groups/<g>`, `ipc/<g>`,
  `sessions/<g>` (and `groups/global` for the main group) — may take at most
  `groups.<g>.disk`, else `limits.disk`, and hold at most `limits.disk_files` entries.
  Space is what the files really take on disk (allocated blocks: a sparse file counts what
  it holds, a file with several hard links counts once, a symlink counts itself and never
  its target). A folder mdclaw cannot read (its mode shuts the daemon out) cannot be
  measured, so it counts as over the limit too;
* **the host's disk** — the file system holding `data_dir` keeps `limits.min_free_disk` free.

Past either rule the group's running container is stopped (for the host's disk: every
running container) and its runs are refused. Its chat is told once per episode, in plain
words, what happened and what to do; the database and the outbox are never held back, so
that message (and everything else already queued) is still delivered. Runs are allowed again
as soon as a measurement is back within the rule.

When: a group is measured before each run of it (`DiskGuard.admit`), and every
`limits.disk_check_interval` while its container runs or while it is refused (`DiskGuard.run`),
off the event loop. A round waits at least ten times as long as the last one took, so
measuring cannot take more than a tenth of one core. Free space (one `fstatvfs`) is checked
every second (`HOST_TICK`) in between while a container starts or runs (or a run was admitted
in the last `ADMIT_WINDOW` seconds), so a fast writer meets the floor within a second; with
no container there is nothing to stop, and the guard only wakes for its rounds.
The walk holds a bounded number of file descriptors and stops at `limits.disk_files`
entries (`agentfs.tree_usage`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mdclaw import agentfs
from mdclaw.config import Config, floor_bytes, format_size
from mdclaw.paths import Layout
from mdclaw.runtime import engine_errors

log = logging.getLogger("mdclaw.diskguard")

HOST_TICK = 1.0  # seconds between free-space checks while a container starts or runs
ADMIT_WINDOW = 60.0  # seconds after admit() the host tick runs even before a container shows

OK = "ok"
GROUP_FULL = "group_full"  # over its disk limit
TOO_MANY_FILES = "too_many_files"  # over limits.disk_files
UNREADABLE = "unreadable"  # a folder the daemon cannot open: cannot be measured
HOST_FULL = "host_full"  # the file system holding data_dir is below limits.min_free_disk


@dataclass(frozen=True)
class Verdict:
    """What one measurement of one group decided."""

    folder: str
    state: str  # OK or one of the reasons above
    used: int = 0  # bytes the group's files take
    limit: int | None = None  # bytes allowed (None: no limit)
    entries: int = 0
    max_entries: int = 0
    unreadable: str = ""  # the first folder that could not be read, relative to data_dir
    free: int | None = None  # bytes free on data_dir's file system (None: not known)
    floor: int = 0  # bytes that must stay free there
    measured_at: float = 0.0  # time.time()
    # What each tree the container can write holds: (path relative to data_dir, bytes,
    # files and folders), for telling where the space went.
    trees: tuple[tuple[str, int, int], ...] = ()

    @property
    def ok(self) -> bool:
        return self.state == OK

    def summary(self) -> str:
        """One line for logs, `mdclaw status` and `mdclaw doctor`."""
        if self.state == HOST_FULL:
            return (f"the disk holding data_dir has {format_size(self.free or 0)} free, below "
                    f"limits.min_free_disk ({format_size(self.floor)}); runs are refused")
        usage = (f"{format_size(self.used)} of {format_size(self.limit)}" if self.limit
                 else f"{format_size(self.used)} (no limit)")
        if self.state == GROUP_FULL:
            return f"group {self.folder} uses {usage}: over its disk limit; runs are refused"
        if self.state == TOO_MANY_FILES:
            return (f"group {self.folder} has more than {self.max_entries} files and folders "
                    f"(limits.disk_files); runs are refused")
        if self.state == UNREADABLE:
            return (f"group {self.folder}: mdclaw cannot read {self.unreadable}, so its size "
                    f"cannot be checked; runs are refused")
        return f"group {self.folder} uses {usage}, {self.entries} files and folders"

    def where(self) -> str:
        """The folder(s) to clean up, relative to data_dir: the tree that holds most of the
        bytes (over the size limit) or of the entries (too many files), else the unreadable
        folder's tree, else groups/<g>."""
        if self.state == UNREADABLE and self.unreadable:
            return "/".join(self.unreadable.split("/")[:2])
        entries = self.state == TOO_MANY_FILES
        held = sorted(((path, n_entries if entries else n_bytes)
                       for path, n_bytes, n_entries in self.trees), key=lambda t: -t[1])
        held = [(path, n) for path, n in held if n]
        if not held:
            return f"groups/{self.folder}"
        total = sum(n for _, n in held)
        # Every tree with a real share of it (a fifth or more), largest first.
        return " and ".join(path for path, n in held if n * 5 >= total)

    def chat_text(self) -> str:
        """The one message the group's chat gets: what happened and what to do."""
        fix = (f"Please ask whoever runs this server to delete files in my folder "
               f"({self.where()} in mdclaw's data directory)")
        if self.state == HOST_FULL:
            return ("I have stopped: the server's disk is nearly full "
                    f"({format_size(self.free or 0)} free, {format_size(self.floor)} must stay "
                    "free). Please ask whoever runs this server to free some space; I will "
                    "work again once there is room.")
        if self.state == GROUP_FULL:
            return (f"I have stopped: my folder is full ({format_size(self.used)} of "
                    f"{format_size(self.limit or 0)}). {fix} or raise my limit "
                    f"(groups.{self.folder}.disk); I will work again once it is below the "
                    "limit.")
        if self.state == TOO_MANY_FILES:
            return (f"I have stopped: my folder holds more than {self.max_entries} files and "
                    f"folders. {fix}; I will work again once there are fewer.")
        if self.state == UNREADABLE:
            return (f"I have stopped: the server cannot read {self.unreadable} in my folder, "
                    f"so it cannot check how much space I use. {fix}, or make that folder "
                    "readable again; I will work again after that.")
        return ""

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary()}


# --------------------------------------------------------------------------- measuring


def group_trees(layout: Layout, folder: str, *, is_main: bool) -> list[tuple[Path, str]]:
    """The (host-owned root, name) of every folder the group's container can write, except
    its extra mounts (host folders the config chose)."""
    trees = [(layout.groups_dir, folder), (layout.ipc_dir, folder),
             (layout.sessions_dir, folder)]
    if is_main:
        trees.append((layout.groups_dir, "global"))
    return trees


def measure_group(layout: Layout, folder: str, *, is_main: bool, max_entries: int
                  ) -> tuple[agentfs.Usage, str, tuple[tuple[str, int, int], ...]]:
    """Space taken by everything the group's container can write, walked by fds; returns the
    usage, the first folder that could not be read ('' if none) and what each tree holds
    (path relative to data_dir, bytes, entries). Blocking."""
    total = agentfs.Usage()
    first = ""
    trees: list[tuple[str, int, int]] = []
    for root, name in group_trees(layout, folder, is_main=is_main):
        try:
            with agentfs.opened(root, name) as fd:
                u = agentfs.tree_usage(fd, max_entries=max(max_entries - total.entries, 0))
        except FileNotFoundError:
            continue
        except (agentfs.UnsafePath, OSError):
            u = agentfs.Usage(unreadable=1)
        trees.append((f"{root.name}/{name}", u.bytes, u.entries))
        total.bytes += u.bytes
        total.entries += u.entries
        total.complete = total.complete and u.complete
        total.unreadable += u.unreadable
        if u.unreadable and not first:
            rel = f"{root.name}/{name}"
            first = f"{rel}/{u.first_unreadable}" if u.first_unreadable else rel
        if not total.complete:
            break
    return total, first, tuple(trees)


def measure_host(cfg: Config) -> agentfs.FreeSpace | None:
    """Free space of the file system holding data_dir (None if it cannot be read). Blocking."""
    path = cfg.data_dir
    while True:  # data_dir may not exist yet (status before the first start)
        try:
            return agentfs.free_space(path)
        except FileNotFoundError:
            if path.parent == path:
                return None
            path = path.parent
        except (agentfs.UnsafePath, OSError):
            return None


def decide(cfg: Config, folder: str, usage: agentfs.Usage | None, unreadable: str,
           space: agentfs.FreeSpace | None,
           trees: tuple[tuple[str, int, int], ...] = ()) -> Verdict:
    """The rule, given measurements: the host's floor first, then the group's limits."""
    limit = cfg.disk_limit(folder)
    floor = floor_bytes(cfg.limits.min_free_disk, space.total) if space else 0
    u = usage or agentfs.Usage()

    def verdict(state: str) -> Verdict:
        return Verdict(state=state, folder=folder, used=u.bytes, limit=limit, entries=u.entries,
                       max_entries=cfg.limits.disk_files, unreadable=unreadable,
                       free=space.free if space else None, floor=floor,
                       measured_at=time.time(), trees=trees)

    if space is not None and space.free < floor:
        return verdict(HOST_FULL)
    if usage is None:
        return verdict(OK)
    if limit is not None and u.bytes > limit:
        return verdict(GROUP_FULL)
    if not u.complete:
        return verdict(TOO_MANY_FILES)
    if u.unreadable:
        return verdict(UNREADABLE)
    return verdict(OK)


def check(cfg: Config, folder: str, *, space: agentfs.FreeSpace | None = None,
          host: bool = True) -> Verdict:
    """Measure group `folder` (and, with `host`, the free space) and decide. Blocking: call
    it in a thread from the event loop."""
    group = cfg.groups.get(folder)
    usage, unreadable, trees = measure_group(Layout(cfg.data_dir), folder,
                                             is_main=bool(group and group.main),
                                             max_entries=cfg.limits.disk_files)
    if space is None and host:
        space = measure_host(cfg)
    return decide(cfg, folder, usage, unreadable, space, trees)


def check_all(cfg: Config, folders: Iterable[str] | None = None) -> dict[str, Any]:
    """Free space and every group's verdict, for `mdclaw status` / `doctor`. Blocking."""
    space = measure_host(cfg)
    floor = floor_bytes(cfg.limits.min_free_disk, space.total) if space else 0
    groups = {f: check(cfg, f, space=space) for f in (folders if folders is not None
                                                       else cfg.groups)}
    return {"free": space.free if space else None, "total": space.total if space else None,
            "floor": floor, "host_ok": space is None or space.free >= floor,
            "groups": {f: v.as_dict() for f, v in groups.items()}}


# --------------------------------------------------------------------------- the daemon's


class DiskGuard:
    """Keeps the rule while the daemon runs.

    `await admit(folder)` before a run: the verdict (a refused one stops nothing; there is
    nothing running yet). `await run(stop)` measures on its own: free space, and every group
    with a running container or refused earlier; a group past its limit gets its container
    stopped, and below the free-space floor every running container is stopped.
    `blocked(folder)` is the verdict a group is refused with, or None; `notice(folder,
    verdict)` returns the chat message once per episode (None when already told).
    """

    def __init__(self, cfg: Config, runner: Any = None, *,
                 running: Callable[[], Iterable[str]] | None = None) -> None:
        self.cfg = cfg
        self.runner = runner
        self._running = running
        self._blocked: dict[str, Verdict] = {}
        self._told: dict[str, str] = {}
        self.space: agentfs.FreeSpace | None = None
        self.last_round: float = 0.0  # seconds the last measuring round took
        self.rounds = 0
        self.host_checks = 0  # free-space-only checks between rounds (check_host)
        self.stopped: list[tuple[str, str, float]] = []  # (folder, state, time.time())
        self._wake = asyncio.Event()
        self._kick = asyncio.Event()  # a run was admitted: start the host tick
        self._admitted = -math.inf  # time.monotonic() of the last admit()

    # ------------------------------------------------------------------ decisions

    def blocked(self, folder: str) -> Verdict | None:
        return self._blocked.get(folder)

    def notice(self, folder: str, verdict: Verdict) -> str | None:
        """The chat message for this refusal, or None when the chat was already told."""
        if self._told.get(folder) == verdict.state:
            return None
        self._told[folder] = verdict.state
        return verdict.chat_text()

    def _record(self, v: Verdict) -> None:
        if v.ok:
            if self._blocked.pop(v.folder, None) is not None:
                log.info("group %s is within its disk limits again: runs are allowed",
                         v.folder)
            self._told.pop(v.folder, None)
            return
        before = self._blocked.get(v.folder)
        self._blocked[v.folder] = v
        if before is None or before.state != v.state:
            log.warning("%s", v.summary())

    async def admit(self, folder: str) -> Verdict:
        """Measure the group and the host now (off the loop); the verdict for a new run."""
        cfg = self.cfg

        def measure() -> tuple[agentfs.FreeSpace | None, Verdict]:
            space = measure_host(cfg)
            return space, check(cfg, folder, space=space, host=False)

        self._admitted = time.monotonic()
        self._kick.set()  # its container is about to start: free space every HOST_TICK
        self.space, v = await asyncio.to_thread(measure)
        self._record(v)
        return v

    # ------------------------------------------------------------------ periodic

    def _watching_host(self) -> bool:
        """Whether free space is checked every HOST_TICK: a container starts or runs, or a
        run was admitted within ADMIT_WINDOW (its container may not show yet)."""
        return bool(self._active()) or time.monotonic() - self._admitted < ADMIT_WINDOW

    def _active(self) -> list[str]:
        if self._running is not None:
            return list(self._running())
        if self.runner is not None:
            return list(self.runner.running())
        return []

    async def _stop(self, folder: str, v: Verdict) -> None:
        handle = self.runner.active(folder) if self.runner is not None else None
        if handle is None:
            return
        log.warning("group %s: stopping its container: %s", folder, v.summary())
        self.stopped.append((folder, v.state, time.time()))
        try:
            await handle.kill()
        except engine_errors() as e:  # the engine may be gone; the next round tries again
            log.error("group %s: could not stop its container: %s", folder, e)

    async def check_once(self) -> list[Verdict]:
        """One round: free space, then every running or refused group; stop offenders."""
        cfg = self.cfg
        t0 = time.monotonic()
        space = await asyncio.to_thread(measure_host, cfg)
        self.space = space
        running = self._active()
        folders = list(dict.fromkeys(running + list(self._blocked)))
        verdicts = []
        for folder in folders:
            v = await asyncio.to_thread(check, cfg, folder, space=space, host=False)
            self._record(v)
            verdicts.append(v)
            if not v.ok and folder in running:
                await self._stop(folder, v)
        self.last_round = time.monotonic() - t0
        self.rounds += 1
        return verdicts

    async def check_host(self) -> list[Verdict]:
        """Free space only (cheap): below the floor, every running container is stopped."""
        cfg = self.cfg
        space = await asyncio.to_thread(measure_host, cfg)
        self.space = space
        self.host_checks += 1
        out = []
        for folder in self._active():
            v = decide(cfg, folder, None, "", space)
            if v.state == HOST_FULL:
                self._record(v)
                out.append(v)
                await self._stop(folder, v)
        return out

    def wake(self) -> None:
        """Measure now (a run started, the config changed)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Measure the groups every `limits.disk_check_interval` (or 10x the last round),
        and free space every `HOST_TICK` while a container starts or runs, until `stop`."""
        next_round = 0.0
        while not stop.is_set():
            woken = self._wake.is_set()
            self._wake.clear()
            self._kick.clear()
            try:
                if woken or time.monotonic() >= next_round:
                    await self.check_once()
                    next_round = time.monotonic() + max(
                        self.cfg.limits.disk_check_interval.total_seconds(),
                        10 * self.last_round)
                elif self._watching_host():
                    await self.check_host()
            except Exception:  # noqa: BLE001 - a failed round must not end the daemon's guard
                log.exception("measuring disk use failed")
            pause = max(0.0, next_round - time.monotonic())
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            if self._watching_host():
                pause = min(HOST_TICK, pause)
            else:  # nothing to stop until a run is admitted: sleep until the next round
                waits.append(asyncio.ensure_future(self._kick.wait()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()

    def status(self) -> dict[str, Any]:
        """For the daemon's status file: free space and the groups refused now."""
        space = self.space
        floor = floor_bytes(self.cfg.limits.min_free_disk, space.total) if space else 0
        return {"free": space.free if space else None, "total": space.total if space else None,
                "floor": floor,
                "blocked": {f: v.as_dict() for f, v in sorted(self._blocked.items())},
                "last_round_ms": round(self.last_round * 1000, 1)}


__all__ = ["GROUP_FULL", "HOST_FULL", "OK", "TOO_MANY_FILES", "UNREADABLE", "DiskGuard",
           "Verdict", "check", "check_all", "decide", "group_trees", "measure_group",
           "measure_host"]
