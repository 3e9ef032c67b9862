"""How read-only commands open the database, and the exit status when they cannot.

Read-only commands (status, doctor, failures, groups list, tasks list/show/logs, outbox
list, ipc errors, containers list, usage) look at the database with `read_db_or_exit()` /
`ready_db_or_exit()` first; when it is not ready they print one line (or one JSON object)
saying so (mdclaw.ops.database) and exit with `DB_EXIT[state]`:

    0  ready
    1  unreadable (not a database, corrupt, permission denied), or another failure
    3  not ready: missing, creating, migrating, older (start the daemon or run
       `mdclaw reconcile`)
    4  newer: made by a newer mdclaw (upgrade mdclaw or restore a backup)
    5  locked: another process keeps readers out (try again in a moment)

Loading the config and failing with a message: mdclaw.ops.console (`mdclaw run` uses them too).
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from mdclaw.commands.output import print_json
from mdclaw.config import Config
from mdclaw.ops.console import fail
from mdclaw.ops.database import READ_TIMEOUT, database_fields, database_line, recheck
from mdclaw.state import Database, DatabaseError, DatabaseInfo, inspect_database

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



class CommandFailed(SystemExit):
    """Exit status 1 with the message already printed to stderr."""



def open_db_or_exit(cfg: Config) -> Database:
    try:
        return Database(cfg.db_path)
    except (DatabaseError, OSError, sqlite3.Error) as e:  # sqlite3: not a database, corrupt...
        fail(f"cannot open state database {cfg.db_path}: {e}")


def database_not_ready(info: DatabaseInfo, path: Path, *, as_json: bool) -> NoReturn:
    """Say the database is not ready (one JSON object on stdout with --json, else one line
    on stderr) and exit with its status from DB_EXIT."""
    if as_json:
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
