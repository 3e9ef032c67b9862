"""Quarantined command files (`mdclaw ipc errors|delete-error`, the operator page)."""

from __future__ import annotations

from mdclaw.config import Config
from mdclaw.ipc.quarantine import delete_error
from mdclaw.paths import Layout


def delete_quarantined(cfg: Config, name: str) -> bool:
    """Delete quarantine entry `name`. Raises QuarantineError for a bad name."""
    return delete_error(Layout(cfg.data_dir).errors_dir, name)
