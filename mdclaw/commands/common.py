"""Helpers every subcommand uses: load the config or explain why not, open the database.

Read-only commands (status, doctor, failures, groups list, tasks list/show/logs, outbox
list, ipc errors, containers list, usage) look at the database with `read_db_or_exit()` /
`ready_db_or_exit()` first; when it is not ready they print one line (or one JSON object)
saying so and exit with `DB_EXIT[state]`:

    0  ready
    1  unreadable (not a database, corrupt, permission denied), or another failure
    3  not ready: missing, creating, migrating, older (start the daemon or run
       `mdclaw reconcile`)
    4  newer: made by a newer mdclaw (upgrade mdclaw or restore a backup)
    5  locked: another process keeps readers out (try again in a moment)
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from mdclaw.config import Config, ConfigError, load_config
from mdclaw.state import Database, DatabaseError, DatabaseInfo, inspect_database
from mdclaw.state.db import read_timeout
from mdclaw.state.migrations import LATEST_VERSION

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOT_READY = 3
EXIT_NEWER = 4
EXIT_LOCKED = 5

DB_EXIT: dict[str, int] = {
    "ready": EXIT_OK, "missing": EXIT_NOT_READY, "creating": EXIT_NOT_READY,
    "migrating": EXIT_NOT_READY, "older": EXIT_NOT_READY, "newer": EXIT_NEWER,
    "locked": EXIT_LOCKED, "unreadable": EXIT_FAILED,
}

# Seconds a read-only command's query waits for another process's lock (the probe before it
# waits PROBE_TIMEOUT); MDCLAW_DB_READ_TIMEOUT=SECONDS sets both (state.db.read_timeout).
READ_TIMEOUT = read_timeout(2.0)


class CommandFailed(SystemExit):
    """Exit status 1 with the message already printed to stderr."""


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"mdclaw: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_or_exit(args) -> Config:  # noqa: ANN001 - argparse namespace
    """The validated config, or every error printed to stderr and exit status 1."""
    try:
        return load_config(args.config)
    except ConfigError as e:
        print(f"mdclaw: invalid config {e.file}:", file=sys.stderr)
        for issue in e.issues:
            print(f"  {issue.render(e.file)}", file=sys.stderr)
        raise SystemExit(1) from None


def open_db_or_exit(cfg: Config) -> Database:
    try:
        return Database(cfg.db_path)
    except (DatabaseError, OSError, sqlite3.Error) as e:  # sqlite3: not a database, corrupt...
        fail(f"cannot open state database {cfg.db_path}: {e}")


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


def database_not_ready(info: DatabaseInfo, path: Path, *, as_json: bool) -> NoReturn:
    """Say the database is not ready (one JSON object on stdout with --json, else one line
    on stderr) and exit with its status from DB_EXIT."""
    if as_json:
        from mdclaw.commands.output import print_json

        print_json(database_fields(info, path))
    else:
        print(f"mdclaw: {database_line(info, path)}", file=sys.stderr)
    raise SystemExit(DB_EXIT[info.state])


def ready_db_or_exit(cfg: Config, *, as_json: bool = False) -> DatabaseInfo:
    """The database's state if it is ready; otherwise say why not and exit (see DB_EXIT).
    For read-only commands, before they read anything."""
    info = inspect_database(cfg.db_path)
    if info.state != "ready":
        database_not_ready(info, cfg.db_path, as_json=as_json)
    return info


def recheck(cfg: Config, error: sqlite3.Error) -> DatabaseInfo:
    """What the database's state is after a query failed: a lock or a migration that came
    in between the check and the query, else `unreadable` with the error."""
    info = inspect_database(cfg.db_path)
    return info if info.state != "ready" else DatabaseInfo("unreadable", info.version,
                                                            error=str(error))


@contextmanager
def read_db_or_exit(cfg: Config, *, as_json: bool = False) -> Iterator[Database]:
    """A read-only connection to a ready database, for a read-only command's queries.
    Not ready, or a query fails (a lock or a migration in between): one line or one JSON
    object, and the exit status from DB_EXIT; never a traceback."""
    ready_db_or_exit(cfg, as_json=as_json)
    try:
        db = Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT)
    except sqlite3.Error as e:
        database_not_ready(recheck(cfg, e), cfg.db_path, as_json=as_json)
    try:
        yield db
    except sqlite3.Error as e:
        database_not_ready(recheck(cfg, e), cfg.db_path, as_json=as_json)
    finally:
        db.close()
