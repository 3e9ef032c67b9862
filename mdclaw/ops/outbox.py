"""Changes to failed outbound messages (`mdclaw outbox retry|drop`, the operator page)."""

from __future__ import annotations

from mdclaw.state import Database
from mdclaw.state.outbox import OutboxError, OutboxRow, drop_failed, retry_failed


def change_outbox_row(db: Database, row_id: int, action: str) -> OutboxRow:
    """`retry` or `drop` failed outbox row `row_id`. Raises OutboxError."""
    op = {"retry": retry_failed, "drop": drop_failed}[action]
    with db.transaction() as conn:
        return op(conn, row_id)


def change_outbox_rows(db: Database, row_ids: list[int], action: str) -> dict[str, object]:
    """`retry` or `drop` each of the failed rows `row_ids` (the operator page's "retry all
    failed", "drop all shown"), each as change_outbox_row: {"done": [ids], "refused": {id:
    why}} (a row that is not failed, or gone, is refused; the others are changed)."""
    done: list[int] = []
    refused: dict[int, str] = {}
    for row_id in dict.fromkeys(row_ids):
        try:
            change_outbox_row(db, row_id, action)
        except OutboxError as e:
            refused[row_id] = str(e)
        else:
            done.append(row_id)
    return {"done": done, "refused": refused}
