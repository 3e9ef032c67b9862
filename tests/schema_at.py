"""A state database made by the schema of an older version: every migration up to it, as
an install of that version left it (for tests of the migrations that follow)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from mdclaw.state.db import _split_sql
from mdclaw.state.migrations import MIGRATIONS


def database_at(path: Path, version: int, *, wal: bool = False) -> sqlite3.Connection:
    """An open connection (autocommit) to a new database at `path` with the schema of
    `version` (0: a file without schema); `wal`: in WAL mode, as the daemon keeps it."""
    conn = sqlite3.connect(path, isolation_level=None)
    if wal:
        conn.execute("PRAGMA journal_mode=WAL")
    for v, _desc, script in MIGRATIONS:
        if v > version:
            break
        for statement in _split_sql(script):
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version={v}")
    return conn
