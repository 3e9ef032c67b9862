"""The state database: SQLite in WAL mode, foreign keys on, migrated on open."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from mdclaw.schedule import to_iso, utc_now
from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS


class DatabaseError(RuntimeError):
    """The database cannot be used (newer schema than this program, corrupt file...)."""


def now_iso(dt: datetime | None = None) -> str:
    """The current time (or `dt`) as ISO-8601 UTC with a trailing Z."""
    return to_iso(dt or utc_now())


class Database:
    """One connection to state.db. Use `transaction()` for every change.

    The connection runs in autocommit mode; `transaction()` opens `BEGIN IMMEDIATE` so a
    writer takes the lock up front and never fails half-way with SQLITE_BUSY.
    """

    def __init__(self, path: str | os.PathLike[str], *, migrate: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        self.conn = sqlite3.connect(
            str(self.path), isolation_level=None, timeout=30, check_same_thread=False
        )
        if new:
            os.chmod(self.path, 0o600)
        self.conn.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        self._depth = 0
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=30000")
        self.conn.execute("PRAGMA foreign_keys=ON")
        if migrate:
            self.migrate()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
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
        """A write transaction (nestable: inner calls join the outer one)."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self.conn
                finally:
                    self._depth -= 1
                return
            self.conn.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self.conn
            except BaseException:
                self._depth = 0
                self.conn.execute("ROLLBACK")
                raise
            self._depth = 0
            self.conn.execute("COMMIT")

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
    """Split a migration script into statements: comments out first, then split at ';'."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [stmt.strip() for stmt in "\n".join(lines).split(";") if stmt.strip()]
