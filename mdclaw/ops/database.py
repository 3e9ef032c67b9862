"""The state database's readiness, for people: one line saying what state it is in and what
to do, and the same as JSON keys. `status`, `doctor` and every read-only command use it
(mdclaw/commands/common.py turns the state into an exit status)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from mdclaw.config import Config
from mdclaw.state import DatabaseInfo, inspect_database
from mdclaw.state.db import read_timeout
from mdclaw.state.migrations import LATEST_VERSION

# Seconds a read-only command's query waits for another process's lock (the probe before it
# waits PROBE_TIMEOUT); MDCLAW_DB_READ_TIMEOUT=SECONDS sets both (state.db.read_timeout).
READ_TIMEOUT = read_timeout(2.0)


def database_line(info: DatabaseInfo, path: Path) -> str:
    """One line for people: the database's state and what to do about it."""
    start = "start the daemon or run `mdclaw reconcile`"
    if info.state == "ready":
        return f"database {path} is ready (schema version {info.version})"
    if info.state == "missing":
        return f"database {path} does not exist yet: {start}"
    if info.state == "creating":
        return (f"database {path} is being created (no schema yet): wait for the daemon, "
                f"or {start}")
    if info.state == "migrating":
        return (f"database {path} is being migrated (schema version {info.version} of "
                f"{LATEST_VERSION}, lacks {', '.join(info.missing_tables)}): wait for the "
                f"daemon, or {start}")
    if info.state == "older":
        return (f"database {path} has schema version {info.version}, older than this "
                f"mdclaw's {LATEST_VERSION}: {start} to migrate it")
    if info.state == "newer":
        return (f"database {path} has schema version {info.version}, newer than this mdclaw "
                f"understands ({LATEST_VERSION}): upgrade mdclaw or restore a backup")
    if info.state == "locked":
        return (f"database {path} is locked by another process ({info.error}): try again "
                "in a moment")
    return f"database {path} cannot be read: {info.error}"


def database_fields(info: DatabaseInfo, path: Path) -> dict[str, Any]:
    """The database's state as JSON keys (`mdclaw status --json` carries them too)."""
    return {"database": info.state, "database_detail": database_line(info, path),
            "schema_version": info.version}


def recheck(cfg: Config, error: sqlite3.Error) -> DatabaseInfo:
    """What the database's state is after a query failed: a lock or a migration that came
    in between the check and the query, else `unreadable` with the error."""
    info = inspect_database(cfg.db_path)
    return info if info.state != "ready" else DatabaseInfo("unreadable", info.version,
                                                            error=str(error))
