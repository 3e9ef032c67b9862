"""State database: schema, migrations and the small repositories the host uses."""

from mdclaw.state.db import (
    Database,
    DatabaseError,
    DatabaseInfo,
    DatabaseState,
    database_state,
    inspect_database,
    now_iso,
)

__all__ = ["Database", "DatabaseError", "DatabaseInfo", "DatabaseState", "database_state",
           "inspect_database", "now_iso", "open_db"]


def open_db(path) -> Database:  # noqa: ANN001 - str or PathLike
    """Open (creating and migrating as needed) the state database at `path`."""
    return Database(path)
