"""A Chromium binary that cannot be started is a ScreenshotError (the action's refusal), and
the throw-away profile folder is removed all the same."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from mdclaw.integrations import ha_screenshot


def test_a_binary_that_cannot_run_fails_cleanly(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "chromium"
    fake.write_text("not a program\n")
    fake.chmod(0o600)  # not executable: starting it raises PermissionError
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    with pytest.raises(ha_screenshot.ScreenshotError, match="PermissionError"):
        asyncio.run(ha_screenshot.capture(
            "http://127.0.0.1:9/lovelace", "secret-token", chromium=str(fake), width=400,
            height=300, zoom=1.0, wait_ms=0, selector=None, timeout=10))
    assert list(temp.iterdir()) == []
