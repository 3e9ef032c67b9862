"""Counting the work SQLite does: the steps of its virtual machine, through a progress
handler (a step count does not change with the machine's speed or load, as a time would)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def vm_steps(conn: sqlite3.Connection, every: int = 1000) -> Iterator[list[int]]:
    """Count the virtual machine steps SQLite takes on `conn` within the block, in units of
    `every`: after the block, `[0]` of what it yields holds the count."""
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    conn.set_progress_handler(tick, every)
    try:
        yield count
    finally:
        conn.set_progress_handler(None, every)
