"""Files agents send (`send_file`): checked on the IPC loop, copied off it.

Applying a `send_file` command only checks the file (the path maps into the group's folder or
one of the mounts its container really has, no symlink on the way, a regular file within the
size limit: an open and an fstat, no read) and records an outbox row whose `source_path`
names it. The copy into the host's spool (`data_dir/spool/outbox/`, out of the container's
reach) is made by `FileSpooler` on a thread of its own, outside the IPC transaction: it opens
the file again with the same checks, copies at most the limit + 1 bytes (a file that grows
past the limit is refused, whatever its size said), then points the row at the copy and
clears `source_path`, or fails the row with the reason. The outbox holds a chat's later rows
behind a row still being copied, so messages keep their order. A crash before the copy is
finished leaves the row with its `source_path`, and the next start copies it then.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from mdclaw import agentfs
from mdclaw.agentfs import UnsafePath
from mdclaw.config import Config, LiveConfig
from mdclaw.ipc.files import SEND_FILE_MAX_BYTES
from mdclaw.mounts import resolve_container_path
from mdclaw.paths import PRIVATE_DIR_MODE, Layout
from mdclaw.state import Database, now_iso

log = logging.getLogger("mdclaw.ipc")

SPOOL_NICE = 10  # the copy thread's niceness (Linux sets it per thread)
SPOOL_NAME_MAX = 100  # characters of the file's own name kept in the spool copy's name


def spool_dir(layout: Layout) -> Path:
    """Where host copies of files agents send wait for delivery."""
    return layout.data_dir / "spool" / "outbox"


def open_source(cfg: Config, layout: Layout, folder: str, container_path: str,
                limit: int = SEND_FILE_MAX_BYTES) -> tuple[int, os.stat_result]:
    """Open the file group `folder`'s container calls `container_path`, for reading.

    Returns (fd, fstat). Raises UnsafePath saying why: outside the group's folder and the
    mounts its container has (the same decisions the runner mounts by), a symlink or a
    non-folder on the way, not a regular file, larger than `limit`.
    """
    try:
        root, parts, _ro = resolve_container_path(cfg, folder, container_path,
                                                  layout.groups_dir)
    except ValueError as e:
        raise UnsafePath(f"send_file {container_path!r}: {e}") from None
    try:
        with agentfs.opened(root) as base:
            return agentfs.open_beneath(base, parts, limit)
    except FileNotFoundError:
        raise UnsafePath(f"send_file {container_path!r}: its folder does not exist") from None
    except UnsafePath as e:
        raise UnsafePath(f"send_file {container_path!r}: {e}") from None


def check_source(cfg: Config, layout: Layout, folder: str, container_path: str) -> str:
    """Check the file can be sent (see `open_source`) without reading it; return its name."""
    fd, _st = open_source(cfg, layout, folder, container_path)
    os.close(fd)
    return container_path.rstrip("/").rsplit("/", 1)[-1]


def copy_to_spool(cfg: Config, layout: Layout, folder: str, container_path: str,
                  row_id: int) -> Path:
    """Copy the file into the spool (at most the limit + 1 bytes read); return the copy.
    Raises UnsafePath (refused, or it grew past the limit) or OSError."""
    fd, _st = open_source(cfg, layout, folder, container_path)
    try:
        base = container_path.rstrip("/").rsplit("/", 1)[-1][-SPOOL_NAME_MAX:]
        name = f"{row_id}-{uuid.uuid4().hex[:12]}-{base}"
        dest = spool_dir(layout)
        agentfs.make_dirs(dest, PRIVATE_DIR_MODE)
        with agentfs.opened(dest) as dfd:
            try:
                agentfs.copy_into(fd, dfd, name, SEND_FILE_MAX_BYTES)
            except UnsafePath as e:
                raise UnsafePath(f"send_file {container_path!r}: {e}") from None
        return dest / name
    finally:
        os.close(fd)


def spool_pending(cfg: Config, db: Database, layout: Layout) -> int:
    """Copy every outbox file row still waiting for its copy; returns how many rows were
    finished (made ready or failed)."""
    # idx_outbox_waiting_copy (the rows with a copy to make), in id order; `+status`: not
    # the status index, whose pending rows may be many more.
    rows = db.query("SELECT id, source_group, source_path FROM outbox "
                    "WHERE source_path IS NOT NULL AND +status = 'pending' ORDER BY id")
    for r in rows:
        try:
            copy = copy_to_spool(cfg, layout, r["source_group"] or "", r["source_path"], r["id"])
        except (UnsafePath, OSError) as e:
            log.warning("outbox %d: %s", r["id"], e)
            with db.transaction() as c:
                c.execute("UPDATE outbox SET status = 'failed', source_path = NULL, "
                          "last_error = ?, updated_at = ? WHERE id = ?",
                          (str(e), now_iso(), r["id"]))
            continue
        with db.transaction() as c:
            c.execute("UPDATE outbox SET file_path = ?, source_path = NULL, updated_at = ? "
                      "WHERE id = ?", (str(copy), now_iso(), r["id"]))
    return len(rows)


class FileSpooler:
    """Runs `spool_pending` on a thread of its own whenever `wake()` is called (and once at
    start, for rows a crash left behind). `on_ready` is called from that thread after rows
    were finished (the daemon wakes the outbox with it)."""

    def __init__(self, cfg: Config | LiveConfig, db_path: Path,
                 on_ready: Callable[[], None] | None = None) -> None:
        # Read for each round of copies: a reload's mounts apply to the next file sent.
        self.live = LiveConfig.of(cfg)
        self.layout = Layout(self.live.current.data_dir)
        self.db_path = db_path
        self.on_ready = on_ready
        self._cond = threading.Condition()
        self._wanted = True
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="ipc-spool", daemon=True)
        self._thread.start()

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    def wake(self) -> None:
        with self._cond:
            self._wanted = True
            self._cond.notify()

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every request so far is done. False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        # Bulk copies yield the CPU to the IPC loop and the rest of the daemon.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SPOOL_NICE)
        db = Database(self.db_path, migrate=False)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._wanted)
                    if self._stop:
                        return
                    self._wanted, self._busy = False, True
                try:
                    done = spool_pending(self.cfg, db, self.layout)
                    if done and self.on_ready is not None:
                        self.on_ready()
                except Exception:  # noqa: BLE001 - keep serving; the next wake or start tries again
                    log.exception("ipc: copying files to the spool failed")
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
        finally:
            db.close()
