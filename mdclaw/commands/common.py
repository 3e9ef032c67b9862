"""Helpers every subcommand uses: load the config or explain why not, open the database."""

from __future__ import annotations

import sqlite3
import sys
from typing import NoReturn

from mdclaw.config import Config, ConfigError, load_config
from mdclaw.state import Database, DatabaseError


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
