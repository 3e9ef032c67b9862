"""Host -> container files in a group's IPC folder, always written atomically.

Follow-ups and the `_close` sentinel in `input/`, action results, and the task and group
snapshots. Every write goes through `mdclaw.agentfs`: the folder is reached without
following symlinks (a container that swaps `input/` for a symlink to somewhere on the host
gets a refusal, not a write there) and the file is a random temp name renamed over the
final one, so the agent never reads half a file and nothing standing at the name is
written through.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mdclaw import agentfs
from mdclaw.agentfs import UnsafePath
from mdclaw.paths import IPC_DIR_MODE, Layout
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.chats import list_chats
from mdclaw.state.groups import GroupRow, list_groups
from mdclaw.state.tasks import TaskRow, list_tasks
from mdclaw.state.transcripts import flush_index

log = logging.getLogger("mdclaw.ipc")

FILE_MODE = 0o640
CLOSE_SENTINEL = "_close"
MIN_ROUND_GAP = 0.01  # seconds between two snapshot rounds, at least
# The snapshot thread folds the WAL into the database (a PASSIVE checkpoint) so the loop's
# commits never reach SQLite's auto-checkpoint (and its fsync on the loop): while the
# watcher runs, its connection's auto-checkpoint is at LOOP_AUTOCHECKPOINT frames, and the
# thread checkpoints once CHECKPOINT_FRAMES frames wait (it looks at the WAL's size at most
# every CHECKPOINT_LOOK seconds it has nothing else to do, sooner while the WAL grows
# fast), or when frames wait and nothing was written for CHECKPOINT_IDLE seconds. A
# checkpoint's CPU grows with its frames, but slower than they do: every half second (as
# before) a trickle of commands paid 70 us each for them, now about 25 (docs/performance.md).
CHECKPOINT_LOOK = 0.2
CHECKPOINT_FRAMES = 2000
CHECKPOINT_IDLE = 1.0
LOOP_AUTOCHECKPOINT = 8000  # SQLite's default is 1,000
CHECKPOINT_EVERY = 0.5  # without the WAL's size (no -shm file to read): every quiet 0.5 s
INDEX_EVERY = 1.0  # seconds between two batches of the transcript's full-text index, at least
# While the IPC loop goes round after round (a burst), the index batch waits for its end, at
# most INDEX_DEFER_MAX seconds (looking every INDEX_RECHECK): its transactions took the write
# lock from the loop's rounds, which waited in SQLite's busy handler (1, 2, 5 ms... a look).
# A search indexes what is queued first, so it finds every row meanwhile.
INDEX_DEFER_MAX = 10.0
INDEX_RECHECK = 0.1


def _dump(obj: Any) -> bytes:
    # Compact on purpose: with `indent` the json module falls back to its pure-Python
    # encoder, ten times slower for a snapshot of every task.
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")


def _open_group_ipc(layout: Layout, folder: str, sub: str | None = None) -> int:
    """Open ipc/<folder>[/<sub>] refusing symlinks at both levels (creating `sub` if absent).

    Raises UnsafePath or OSError.
    """
    root = agentfs.open_root(layout.ipc_dir)
    try:
        gfd = agentfs.open_dir(folder, root)
    finally:
        os.close(root)
    if sub is None:
        return gfd
    try:
        return agentfs.ensure_dir(gfd, sub, IPC_DIR_MODE)
    finally:
        os.close(gfd)


def write_in_group(layout: Layout, folder: str, sub: str | None, name: str, data: bytes,
                   mode: int = FILE_MODE) -> None:
    """Atomically write ipc/<folder>/[<sub>/]<name>. Raises UnsafePath or OSError."""
    fd = _open_group_ipc(layout, folder, sub)
    try:
        agentfs.atomic_write(fd, name, data, mode)
    finally:
        os.close(fd)


class _FollowUpNames:
    """File names for follow-ups that sort in the order they were written. The agent reads
    `input/` in name order: a name is the millisecond (never going back within this process,
    whatever the clock does), then a counter for names of the same millisecond, then a
    random part (two hosts never share a folder; it keeps a name unguessable all the same)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ms = 0
        self._n = 0

    def next(self) -> str:
        with self._lock:
            ms = time.time_ns() // 1_000_000
            if ms > self._ms:
                self._ms, self._n = ms, 0
            else:
                self._n += 1
            return f"{self._ms:013d}-{self._n:06d}-{secrets.token_hex(4)}.json"


_follow_up_names = _FollowUpNames()


def write_follow_up(layout: Layout, folder: str, *, sender: str, sender_name: str,
                    content: str, timestamp: str | None = None,
                    chat_jid: str | None = None) -> str:
    """Queue a follow-up message for the group's running agent in ipc/<folder>/input/; the
    agent reads follow-ups in the order they were written. `chat_jid`: the chat it came
    from (a group with several chats), where the agent's tools then answer by default.

    Returns the file name. Raises UnsafePath (input/ swapped for a symlink) or OSError.
    """
    name = _follow_up_names.next()
    body = {"sender": sender, "sender_name": sender_name, "content": content,
            "timestamp": timestamp or to_iso(utc_now())}
    if chat_jid:
        body["chat_jid"] = chat_jid
    write_in_group(layout, folder, "input", name, _dump(body), 0o660)
    return name


def write_close(layout: Layout, folder: str) -> None:
    """Write the empty ipc/<folder>/input/_close sentinel (it ends the agent's conversation).

    Raises UnsafePath (input/ swapped for a symlink) or OSError.
    """
    fd = _open_group_ipc(layout, folder, "input")
    try:
        agentfs.write_sentinel(fd, CLOSE_SENTINEL, 0o660)
    finally:
        os.close(fd)


def remove_close(layout: Layout, folder: str) -> None:
    """Remove a stale ipc/<folder>/input/_close (it would end the next run at once). A
    folder standing there is left alone; a symlink is removed, never followed."""
    try:
        fd = _open_group_ipc(layout, folder, "input")
    except (UnsafePath, FileNotFoundError):
        return
    try:
        agentfs.unlink(fd, CLOSE_SENTINEL)
    finally:
        os.close(fd)


def write_action_result(group_fd: int, request_id: str, body: dict[str, Any]) -> None:
    """Write action_results/<request_id>.json under the open group IPC folder `group_fd`.

    Raises UnsafePath if action_results/ is a symlink, OSError if it cannot be written.
    """
    fd = agentfs.ensure_dir(group_fd, "action_results", IPC_DIR_MODE)
    try:
        agentfs.atomic_write(fd, f"{request_id}.json", _dump(body), FILE_MODE)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- snapshots


def task_snapshot_entry(t: TaskRow) -> dict[str, Any]:
    return {"id": t.id, "groupFolder": t.group_folder, "chat_jid": t.chat_jid,
            "prompt": t.prompt, "schedule_type": t.schedule_type,
            "schedule_value": t.schedule_value, "context_mode": t.context_mode,
            "status": t.status, "next_run": t.next_run, "last_run": t.last_run,
            "timezone": t.timezone}


def tasks_snapshot(tasks: list[TaskRow], folder: str, is_main: bool) -> list[dict[str, Any]]:
    """What current_tasks.json holds for `folder`: every task for main, else its own."""
    return [task_snapshot_entry(t) for t in tasks if is_main or t.group_folder == folder]


def groups_snapshot(groups: list[GroupRow], chats: list[dict[str, Any]], is_main: bool,
                    now: str | None = None) -> dict[str, Any]:
    """What available_groups.json holds: registered groups and known chats (main only).
    A registered group is one entry with every chat it answers in (`chats`, the first one
    first: where its tasks report) and its `session`; `jid` is its first chat and
    `lastActivity` the newest of its chats' (as they were before groups had several)."""
    now = now or to_iso(utc_now())
    if not is_main:
        return {"groups": [], "lastSync": now}
    activity = {c["jid"]: c for c in chats}
    out = []
    seen: set[str] = set()
    for g in groups:
        if not g.jid:
            continue
        mine = []
        for n, jid in enumerate(g.all_chats):
            seen.add(jid)
            chat = activity.get(jid) or {}
            mine.append({"jid": jid, "name": chat.get("name") or jid,
                         "lastActivity": chat.get("last_activity"), "first": n == 0})
        times = [str(c["lastActivity"]) for c in mine if c["lastActivity"]]
        out.append({"jid": g.jid, "name": g.name, "folder": g.folder,
                    "lastActivity": max(times) if times else None,
                    "isRegistered": True, "chats": mine, "session": g.session})
    for c in chats:
        if c["jid"] in seen:
            continue
        out.append({"jid": c["jid"], "name": c["name"] or c["jid"], "folder": None,
                    "lastActivity": c["last_activity"], "isRegistered": False})
    return {"groups": out, "lastSync": now}


def chats_snapshot(group: GroupRow, known: Mapping[str, Mapping[str, Any]],
                   first: Mapping[str, str], now: str | None = None) -> dict[str, Any]:
    """What chats.json holds for `group`: the chats it answers in (the first is where tasks
    report and messages go by default), its session mode, and where else it may send.
    `known`: the chats the host knows by jid; `first`: each group's first chat."""
    mine = []
    for n, jid in enumerate(group.all_chats):
        c = known.get(jid) or {}
        mine.append({"jid": jid, "name": c.get("name") or jid,
                     "channel": c.get("channel") or jid.split(":", 1)[0],
                     "lastActivity": c.get("last_activity"), "first": n == 0})
    send_to = [{"group": d, "jid": first.get(d)} if d in first else {"jid": d}
               for d in group.may_send_to]
    return {"chats": mine, "session": group.session, "maySendTo": send_to,
            "lastSync": now or to_iso(utc_now())}


def write_snapshots(db: Database, layout: Layout, folders: set[str] | None = None, *,
                    tasks: bool = True, groups: bool = True) -> list[str]:
    """Rewrite current_tasks.json and/or available_groups.json and chats.json for `folders`
    (None: every registered group). Returns the folders written; a folder that cannot be
    written (absent, swapped for a symlink) is logged and skipped."""
    all_groups = list_groups(db)
    task_rows = list_tasks(db) if tasks else []
    chats = list_chats(db) if groups else []
    known = {c["jid"]: c for c in chats}
    first = {g.folder: g.jid for g in all_groups if g.jid}
    now = to_iso(utc_now())
    # Each group's tasks in one pass, and each file's bytes made once per kind (main / other):
    # with 1,000 groups and 100,000 tasks, filtering the task list per group took seconds.
    by_folder: dict[str, list[TaskRow]] = {}
    for t in task_rows:
        by_folder.setdefault(t.group_folder, []).append(t)
    main_tasks: bytes | None = None
    groups_bytes: dict[bool, bytes] = {}
    written = []
    for g in all_groups:
        if folders is not None and g.folder not in folders:
            continue
        try:
            fd = _open_group_ipc(layout, g.folder)
        except (UnsafePath, OSError) as e:
            log.debug("ipc: no snapshots for %s: %s", g.folder, e)
            continue
        try:
            if tasks:
                if g.is_main:
                    if main_tasks is None:
                        main_tasks = _dump(tasks_snapshot(task_rows, g.folder, True))
                    body = main_tasks
                else:
                    body = _dump(tasks_snapshot(by_folder.get(g.folder, []), g.folder, False))
                agentfs.atomic_write(fd, "current_tasks.json", body, durable=False)
            if groups:
                if g.is_main not in groups_bytes:
                    groups_bytes[g.is_main] = _dump(
                        groups_snapshot(all_groups, chats, g.is_main, now))
                agentfs.atomic_write(fd, "available_groups.json", groups_bytes[g.is_main],
                                     durable=False)
                agentfs.atomic_write(fd, "chats.json", _dump(
                    chats_snapshot(g, known, first, now)), durable=False)
            written.append(g.folder)
        except OSError as e:
            log.warning("ipc: cannot write snapshots for %s: %s", g.folder, e)
        finally:
            os.close(fd)
    return written


class SnapshotWriter:
    """Rewrites snapshots on a background thread, so the IPC loop never waits for them.

    Requests are coalesced: while one round is written, later requests pile up and the next
    round writes each affected folder once, from the database as it is then. The thread
    reads through its own SQLite connection (WAL lets it read while the loop writes).

    The same thread keeps the database: in quiet moments it checkpoints the WAL, and about
    once a second (at start at once, and before it stops) it moves the transcript rows
    queued since into the full-text index, a batch per transaction (mdclaw.state.transcripts):
    storing a message or a reply never writes the index itself. `busy` (the IPC loop's: a
    burst is under way) puts that off until it returns False, or INDEX_DEFER_MAX seconds
    have passed; `index_deferrals` counts the looks that put it off.
    """

    def __init__(self, db_path: Path, layout: Layout, *,
                 busy: Callable[[], bool] | None = None) -> None:
        self.db_path = db_path
        self.layout = layout
        self.busy = busy
        self.index_deferrals = 0
        self._cond = threading.Condition()
        self._tasks: set[str] | None = set()  # None: every group
        self._groups: set[str] | None = set()
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ipc-snapshots", daemon=True)
        self._thread.start()

    def request(self, folders: set[str] | None, *, tasks: bool, groups: bool) -> None:
        """Ask for the snapshots of `folders` (None: all) to be rewritten soon."""
        with self._cond:
            if tasks:
                self._tasks = None if folders is None or self._tasks is None else (
                    self._tasks | folders)
            if groups:
                self._groups = None if folders is None or self._groups is None else (
                    self._groups | folders)
            self._cond.notify()

    def _has_work(self) -> bool:
        return self._tasks is None or self._groups is None or bool(self._tasks or self._groups)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every request so far is written. False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy and not self._has_work(),
                                       timeout)

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _in_a_burst(self) -> bool:
        if self.busy is None:
            return False
        try:
            return self.busy()
        except Exception:  # noqa: BLE001 - the thread goes on (snapshots, checkpoints)
            log.exception("ipc: asking whether a burst is under way failed")
            return False

    @staticmethod
    def _index(db: Database) -> None:
        try:
            flush_index(db.conn, yielding=True)
        except sqlite3.Error as e:  # busy or locked: the next second tries again
            log.warning("ipc: indexing the transcript failed: %s", e)

    @staticmethod
    def _checkpoint(db: Database) -> None:
        try:
            db.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as e:  # busy or locked: the next quiet moment tries again
            log.debug("ipc: WAL checkpoint skipped: %s", e)

    def _run(self) -> None:
        db = Database(self.db_path, migrate=False)
        last_frames = -1  # the WAL's frames at the last look
        changed_at = looked_at = time.monotonic()  # when they last moved; the last look
        checked_at = 0.0  # the last checkpoint (without the WAL's size)
        look = CHECKPOINT_LOOK  # until the next look: sooner while the WAL grows fast
        index_at = 0.0  # time.monotonic() of the next index batch: at start, what a crash
        # or another process left queued
        put_off_at: float | None = None  # when the batch due was first put off (a burst)
        try:
            while True:
                now = time.monotonic()
                if now >= index_at:
                    if self._in_a_burst() and (
                            put_off_at is None or now - put_off_at < INDEX_DEFER_MAX):
                        if put_off_at is None:
                            put_off_at = now
                        self.index_deferrals += 1
                        index_at = now + INDEX_RECHECK
                    else:
                        put_off_at = None
                        self._index(db)
                        index_at = time.monotonic() + INDEX_EVERY
                with self._cond:
                    woke = self._cond.wait_for(
                        lambda: self._stop or self._has_work(),
                        max(0.0, min(looked_at + look, index_at) - time.monotonic()))
                    stopping = woke and not self._has_work()
                if not woke:
                    # Quiet moment: index what is due (the top of the loop), then fold the
                    # WAL into the database when enough waits (see CHECKPOINT_FRAMES), so the
                    # loop's own commits do not hit SQLite's auto-checkpoint (and its fsync).
                    now = time.monotonic()
                    if now < looked_at + look:
                        continue  # woken for the index batch, not for a look at the WAL
                    wal = db.wal_frames()
                    if wal is None:
                        looked_at = now
                        if now - checked_at >= CHECKPOINT_EVERY:
                            checked_at = now
                            self._checkpoint(db)
                        continue
                    frames, done = wal
                    # Frames a second since the last look (the WAL restarts from its start
                    # after a checkpoint that folded it all in).
                    grown = frames - last_frames if frames >= last_frames else frames
                    rate = grown / max(now - looked_at, 1e-3)
                    looked_at = now
                    if frames != last_frames:
                        last_frames, changed_at = frames, now
                    waiting = frames - done
                    if waiting >= CHECKPOINT_FRAMES or (
                            waiting > 0 and now - changed_at >= CHECKPOINT_IDLE):
                        self._checkpoint(db)
                        waiting = 0
                    # Idle (no frame since the last look): a look a second, as cheap as the
                    # old checkpoint every half second was when idle.
                    look = CHECKPOINT_IDLE if rate <= 0 else min(
                        CHECKPOINT_LOOK, max(0.02, (CHECKPOINT_FRAMES - waiting) / rate))
                    continue
                if stopping:
                    self._index(db)
                    return
                with self._cond:
                    tasks, groups = self._tasks, self._groups
                    self._tasks, self._groups = set(), set()
                    self._busy = True
                started = time.monotonic()
                try:
                    if tasks is None or tasks:
                        write_snapshots(db, self.layout, tasks, tasks=True, groups=False)
                    if groups is None or groups:
                        write_snapshots(db, self.layout, groups, tasks=False, groups=True)
                except Exception:  # noqa: BLE001 - keep serving; the next change rewrites them
                    log.exception("ipc: writing snapshots failed")
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
                # Under a burst, rewriting every snapshot after every batch would take more
                # time than applying the commands: pause in proportion to the last round, so
                # the snapshots lag a burst by a few rounds at most and never starve the loop.
                pause = min(0.5, MIN_ROUND_GAP + 4 * (time.monotonic() - started))
                with self._cond:
                    self._cond.wait_for(lambda: self._stop, pause)
        finally:
            db.close()
