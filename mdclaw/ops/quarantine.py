"""Quarantined command files (`mdclaw ipc errors|delete-error`, the operator page)."""

from __future__ import annotations

from mdclaw.config import Config
from mdclaw.ipc.quarantine import QuarantineError, delete_error
from mdclaw.paths import Layout


def delete_quarantined(cfg: Config, name: str) -> bool:
    """Delete quarantine entry `name`. Raises QuarantineError for a bad name."""
    return delete_error(Layout(cfg.data_dir).errors_dir, name)


def delete_many(cfg: Config, names: list[str]) -> dict[str, object]:
    """Delete each quarantine entry of `names` (the operator page's "delete all shown"), as
    delete_quarantined: {"deleted": [...], "refused": {name: why}} (gone: "not found")."""
    deleted: list[str] = []
    refused: dict[str, str] = {}
    for name in dict.fromkeys(names):
        try:
            found = delete_quarantined(cfg, name)
        except QuarantineError as e:
            refused[name] = str(e)
            continue
        if found:
            deleted.append(name)
        else:
            refused[name] = "not found"
    return {"deleted": deleted, "refused": refused}
