"""Changes to failed outbound messages (`mdclaw outbox retry|drop`, the operator page)."""

from __future__ import annotations

from mdclaw.state import Database
from mdclaw.state.outbox import OutboxRow, drop_failed, retry_failed


def change_outbox_row(db: Database, row_id: int, action: str) -> OutboxRow:
    """`retry` or `drop` failed outbox row `row_id`. Raises OutboxError."""
    op = {"retry": retry_failed, "drop": drop_failed}[action]
    with db.transaction() as conn:
        return op(conn, row_id)
