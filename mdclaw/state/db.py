"""The state database: SQLite in WAL mode, foreign keys on, migrated on open."""

from __future__ import annotations

import functools
import os
import sqlite3
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from mdclaw.errors import StateError
from mdclaw.schedule import iso_now, to_iso
from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS

DEFAULT_AUTOCHECKPOINT = 1000  # SQLite's: WAL frames after which a commit checkpoints
_SHM_VERSION = 3007000  # the wal-index header's iVersion since SQLite 3.7.0
_U32 = struct.Struct("=I")


class DatabaseError(StateError, RuntimeError):
    """The database cannot be used (newer schema than this program, corrupt file...)."""


def now_iso(dt: datetime | None = None) -> str:
    """The current time (or `dt`) as ISO-8601 UTC with a trailing Z."""
    return iso_now() if dt is None else to_iso(dt)


class Database:
    """One connection to state.db. Use `transaction()` for every change.

    The connection runs in autocommit mode; `transaction()` opens `BEGIN IMMEDIATE` so a
    writer takes the lock up front and never fails half-way with SQLITE_BUSY.

    `readonly=True` is for the CLI's read-only commands: it opens an existing file read-only
    (`mode=ro`), never creates, migrates or switches the journal mode, and waits at most
    `timeout` seconds for a lock. Check `inspect_database()` first.
    """

    def __init__(self, path: str | os.PathLike[str], *, migrate: bool = True,
                 readonly: bool = False, timeout: float = 30.0) -> None:
        self.path = Path(path)
        self._lock = threading.RLock()
        self._depth = 0
        self._shm_fd: int | None = None  # the -shm file, once wal_frames() opened it
        if readonly:
            self.conn = connect_readonly(self.path, timeout)
            self.conn.row_factory = sqlite3.Row
            self.conn.execute("PRAGMA query_only=ON")
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self.conn = sqlite3.connect(
            str(self.path), isolation_level=None, timeout=timeout, check_same_thread=False
        )
        if new:
            os.chmod(self.path, 0o600)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        self.conn.execute("PRAGMA foreign_keys=ON")
        if migrate:
            self.migrate()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None
        self.conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def user_version(self) -> int:
        return int(self.conn.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self) -> list[int]:
        """Apply every pending migration in order; return the versions applied.

        Raises DatabaseError if the file was made by a newer mdclaw.
        """
        current = self.user_version
        if current > LATEST_VERSION:
            raise DatabaseError(
                f"{self.path} has schema version {current}, newer than this mdclaw "
                f"understands ({LATEST_VERSION}); upgrade mdclaw or restore a backup"
            )
        applied = []
        for version, _desc, script in MIGRATIONS:
            if version <= current:
                continue
            with self._lock:
                # Table rebuilds need foreign keys off; it cannot change inside a transaction.
                self.conn.execute("PRAGMA foreign_keys=OFF")
                try:
                    self.conn.execute("BEGIN IMMEDIATE")
                    try:
                        for statement in _split_sql(script):
                            self.conn.execute(statement)
                        bad = self.conn.execute("PRAGMA foreign_key_check").fetchall()
                        if bad:
                            raise DatabaseError(
                                f"migration {version} broke foreign keys: {bad[:3]}")
                        self.conn.execute(f"PRAGMA user_version={version}")
                        self.conn.execute("COMMIT")
                    except BaseException:
                        self.conn.execute("ROLLBACK")
                        raise
                finally:
                    self.conn.execute("PRAGMA foreign_keys=ON")
            applied.append(version)
        return applied

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (nestable: inner calls join the outer one); begin() and
        end() around the body."""
        conn = self.begin()
        try:
            yield conn
        except BaseException:
            self.end(commit=False)
            raise
        self.end(commit=True)

    def begin(self) -> sqlite3.Connection:
        """Open a write transaction (nestable: an inner one joins the outer) without a
        context manager (the IPC loop's round, once a command at a trickle): the caller
        must call end() exactly once, in a `finally` or on every path."""
        self._lock.acquire()
        if self._depth:
            self._depth += 1
            return self.conn
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        self._depth = 1
        return self.conn

    def end(self, *, commit: bool) -> None:
        """End what begin() opened: COMMIT, or ROLLBACK (`commit` False, on an error). An
        inner (nested) end leaves the outer transaction to its owner. A COMMIT that fails
        rolls back what it could not commit and raises."""
        try:
            if self._depth > 1:
                self._depth -= 1
                return
            self._depth = 0
            if not commit:
                self.conn.execute("ROLLBACK")
                return
            try:
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
        finally:
            self._lock.release()

    def wal_frames(self) -> tuple[int, int] | None:
        """(frames in the WAL, frames of it already copied into the database), read from
        the wal-index header in the `-shm` file (sqlite.org/walformat.html: mxFrame at byte
        16, nBackfill at byte 96, native byte order), one `pread`; None if it cannot be read
        (no such file, another format). A hint for deciding when to checkpoint: a read torn
        by a concurrent commit at worst checkpoints a little early or late."""
        if self._shm_fd is None:
            try:
                self._shm_fd = os.open(f"{self.path}-shm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            head = os.pread(self._shm_fd, 100, 0)
        except OSError:
            return None
        if len(head) < 100 or _U32.unpack_from(head, 0)[0] != _SHM_VERSION:
            return None
        return _U32.unpack_from(head, 16)[0], _U32.unpack_from(head, 96)[0]

    def set_autocheckpoint(self, frames: int) -> None:
        """After how many WAL frames a commit of this connection checkpoints the WAL
        (`PRAGMA wal_autocheckpoint`; 0 turns it off)."""
        with self._lock:
            self.conn.execute(f"PRAGMA wal_autocheckpoint={int(frames)}")

    def change_mark(self) -> tuple[int, int]:
        """A value that moves whenever anything is committed to the database: by another
        connection (`PRAGMA data_version`) or by this one (`total_changes`). Cheap: no table
        is read."""
        with self._lock:
            return (int(self.conn.execute("PRAGMA data_version").fetchone()[0]),
                    self.conn.total_changes)

    def query(self, sql: str, params: tuple | dict = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.conn.execute(sql, params).fetchall()

    def query_one(self, sql: str, params: tuple | dict = ()) -> sqlite3.Row | None:
        with self._lock:
            return self.conn.execute(sql, params).fetchone()

    def scalar(self, sql: str, params: tuple | dict = ()) -> Any:
        """The first column of the first row of an aggregate query (`SELECT COUNT(*)...`).
        Raises DatabaseError if the query gives no row."""
        row = self.query_one(sql, params)
        if row is None:
            raise DatabaseError(f"no row from {sql.split()[0]} query")
        return row[0]


def _split_sql(script: str) -> list[str]:
    """Split a migration script into statements: comments out first, then split at ';'.
    A piece that is not a complete statement yet (a trigger's body has ';' inside its
    BEGIN ... END) is joined with the next ones until it is."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    out: list[str] = []
    pending = ""
    for piece in "\n".join(lines).split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \n;"):
                out.append(pending.strip().removesuffix(";").strip())
            pending = ""
    if pending.strip(" \n;"):
        out.append(pending.strip().removesuffix(";").strip())
    return out


# ---------------------------------------------------------------------- read-only probing

DatabaseState = Literal["missing", "creating", "migrating", "older", "newer", "locked",
                        "unreadable", "ready"]


def read_timeout(default: float) -> float:
    """`default`, or MDCLAW_DB_READ_TIMEOUT (seconds) when that is set: how long a read-only
    look at the database waits for another process's lock (tests of a locked database set
    it short rather than wait the default out in every command they run)."""
    try:
        return float(os.environ.get("MDCLAW_DB_READ_TIMEOUT") or default)
    except ValueError:
        return default


PROBE_TIMEOUT = read_timeout(1.0)  # seconds a read-only probe waits for another process's lock


@dataclass(frozen=True)
class DatabaseInfo:
    """What a read-only look at state.db found: its state, its schema version (when it
    could be read), the tables it lacks for that version, and the error behind
    `locked`/`unreadable`."""

    state: DatabaseState
    version: int | None = None
    missing_tables: tuple[str, ...] = ()
    error: str = ""


def connect_readonly(path: Path, timeout: float = PROBE_TIMEOUT) -> sqlite3.Connection:
    """A read-only connection to an existing database file (never creates one).

    A reader that may not write the database's folder (a member of the service's group
    reading a 0750 data_dir) cannot create the WAL index (`state.db-shm`) a WAL database
    needs. That file exists whenever a connection has the database open (the running daemon
    keeps one), so its absence means no writer is there: the file is read as it stands
    (`immutable=1`). With the daemon running, the ordinary read-only open works.
    """
    uri = path.absolute().as_uri() + "?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=timeout,
                           check_same_thread=False)
    try:
        conn.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as e:
        code = getattr(e, "sqlite_errorcode", 0) or 0
        shm = path.with_name(path.name + "-shm")
        if code & 0xFF != sqlite3.SQLITE_READONLY or shm.exists() or \
                os.access(path.parent, os.W_OK):
            return conn  # the caller's first query reports it
        conn.close()
        conn = sqlite3.connect(uri + "&immutable=1", uri=True, isolation_level=None,
                               timeout=timeout, check_same_thread=False)
    return conn


@functools.cache
def tables_by_version() -> dict[int, frozenset[str]]:
    """The tables a database has after each migration, found by running the migrations on
    an in-memory database (so the list is never written twice)."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    try:
        out = {0: frozenset[str]()}
        for version, _desc, script in MIGRATIONS:
            for statement in _split_sql(script):
                conn.execute(statement)
            out[version] = _table_names(conn)
        return out
    finally:
        conn.close()


def tables_at(version: int) -> frozenset[str]:
    """The tables a database at schema `version` has: those of the newest migration at or
    below it (numbers may have gaps while branches that add migrations are merged)."""
    known = tables_by_version()
    return known[max(v for v in known if v <= version)] if version >= 0 else frozenset()


def _table_names(conn: sqlite3.Connection) -> frozenset[str]:
    return frozenset(r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"))


def _busy(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(e) or "busy" in str(e)


def inspect_database(path: str | os.PathLike[str], *,
                     timeout: float = PROBE_TIMEOUT) -> DatabaseInfo:
    """Look at the database at `path` read-only, waiting at most `timeout` seconds for a
    lock, and say which state it is in:

    - missing: no file (the daemon or `mdclaw reconcile` has not made it yet);
    - creating: a file without any schema yet (being created right now);
    - migrating: the schema lacks tables its version should have (half built);
    - older: a complete schema of an earlier version, not migrated (yet) to this mdclaw's;
    - newer: made by a newer mdclaw (user_version above LATEST_VERSION);
    - locked: another process holds a lock that keeps readers out;
    - unreadable: not a database, corrupt, or not readable by this user;
    - ready: this mdclaw's schema, readable.

    Version and tables are read in one transaction, so they belong to the same commit.
    Never writes, never creates the file, never raises.
    """
    p = Path(path)
    try:
        if not p.exists():
            return DatabaseInfo("missing")
        conn = connect_readonly(p, timeout)
    except OSError as e:
        return DatabaseInfo("unreadable", error=str(e))
    except sqlite3.Error as e:
        if not p.exists():  # removed between the look and the open
            return DatabaseInfo("missing")
        return DatabaseInfo("locked" if _busy(e) else "unreadable", error=str(e))
    try:
        conn.execute("BEGIN")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        tables = _table_names(conn)
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        return DatabaseInfo("locked" if _busy(e) else "unreadable", error=str(e))
    finally:
        conn.close()
    if version > LATEST_VERSION:
        return DatabaseInfo("newer", version)
    if version == 0:
        return DatabaseInfo("older" if tables else "creating", version)
    lacking = tuple(sorted(tables_at(version) - tables))
    if lacking:
        return DatabaseInfo("migrating", version, lacking)
    return DatabaseInfo("older" if version < LATEST_VERSION else "ready", version)


def database_state(path: str | os.PathLike[str], *,
                   timeout: float = PROBE_TIMEOUT) -> DatabaseState:
    """`inspect_database(path).state`: one of missing, creating, migrating, older, newer,
    locked, unreadable, ready."""
    return inspect_database(path, timeout=timeout).state
