"""The config holder: components read `current` at use time; subscribers hear of a change;
a holder made from a plain Config never changes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mdclaw.config import Config, LiveConfig, load_config
from mdclaw.diskguard import DiskGuard
from mdclaw.runner import ContainerRunner


def cfg_with(tmp_path: Path, name: str) -> Config:
    return load_config(tmp_path / "c.yaml",
                       text=f"data_dir: {tmp_path}\nassistant: {{name: {name}}}\n")


def test_subscribers_hear_each_change_in_order_and_a_failing_one_stops_no_other(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = cfg_with(tmp_path, "A"), cfg_with(tmp_path, "B")
    live = LiveConfig(a)
    heard: list[tuple[str, str, str]] = []

    def broken(old: Config, new: Config) -> None:
        raise RuntimeError("cannot apply")

    live.subscribe(lambda old, new: heard.append(("first", old.assistant.name,
                                                  new.assistant.name)))
    live.subscribe(broken)
    stop = live.subscribe(lambda old, new: heard.append(("last", old.assistant.name,
                                                         new.assistant.name)))
    with caplog.at_level(logging.ERROR):
        failed = live.replace(b)
    assert live.current is b
    assert heard == [("first", "A", "B"), ("last", "A", "B")]
    assert len(failed) == 1 and "broken" in failed[0] and "cannot apply" in failed[0]
    assert "could not apply the new config" in caplog.text
    stop()
    live.replace(a)
    assert heard[-1] == ("first", "B", "A") and len(heard) == 3


def test_a_plain_config_is_a_holder_that_never_changes(tmp_path: Path) -> None:
    a = cfg_with(tmp_path, "A")
    fixed = LiveConfig.of(a)
    assert fixed.current is a and fixed.fixed
    with pytest.raises(TypeError):
        fixed.replace(cfg_with(tmp_path, "B"))
    live = LiveConfig(a)
    assert LiveConfig.of(live) is live


def test_components_read_the_holder_at_use_time(tmp_path: Path) -> None:
    a, b = cfg_with(tmp_path, "A"), cfg_with(tmp_path, "B")
    live = LiveConfig(a)
    runner = ContainerRunner(live, runtime=None)  # type: ignore[arg-type]
    guard = DiskGuard(live)
    assert runner.cfg is a and guard.cfg is a
    live.replace(b)
    assert runner.cfg is b and guard.cfg is b
    assert ContainerRunner(a, runtime=None).cfg is a  # type: ignore[arg-type]
