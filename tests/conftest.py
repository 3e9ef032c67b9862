"""Shared fixtures: config files in a temporary data dir, the real CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent

# Property tests never time an example: Hypothesis' default 200 ms deadline and its "too
# slow to generate" health check fail on a loaded machine, not on a bug. Under CI=true the
# examples are also derandomized (seeded from each test's name), so that a CI run checks the
# same examples every time; local runs keep exploring new ones.
settings.register_profile("mdclaw", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mdclaw-ci", settings.get_profile("mdclaw"), derandomize=True,
                          database=None)
settings.load_profile("mdclaw-ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes")
                      else "mdclaw")

# The end-to-end tests build and start images on a real engine: a larger bound than the
# suite's `timeout` (pyproject.toml), still one that fails a hung test with its traceback.
E2E_TIMEOUT = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT))


BASE_CONFIG = """\
data_dir: {data_dir}
assistant:
  name: Andy
  timezone: Europe/Berlin
groups:
  main:
    name: Admin chat
    jid: "tg:123456"
    main: true
    requires_trigger: false
  family:
    name: Family
    jid: "tg:-1001234"
    trigger: "@Andy"
    timeout: 10m
limits:
  max_concurrent_containers: 5
"""


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def write_config(tmp_path: Path, data_dir: Path):
    """write_config(text=None) -> path; `{data_dir}` in the text is filled in."""

    def _write(text: str | None = None, name: str = "config.yaml") -> Path:
        body = textwrap.dedent(text) if text is not None else BASE_CONFIG
        p = tmp_path / name
        p.write_text(body.replace("{data_dir}", str(data_dir)))
        return p

    return _write


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m mdclaw ARGS` in a subprocess and return the completed process."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "mdclaw", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, input=input)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(autouse=True)
def _fake_engines_end_with_the_test() -> Iterator[None]:
    """Containers of tests/fake_engine.py's engines do not outlive their test, and a
    container script that failed fails the test."""
    yield
    engines = sys.modules.get("fake_engine")
    if engines is not None:
        engines.shutdown_all()


@pytest.fixture(autouse=True)
def _no_ambient_mdclaw_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("MDCLAW_"):
            monkeypatch.delenv(k)


@pytest.fixture(scope="session")
def mail_world() -> Iterator[Any]:
    """Dovecot and an SMTP server on loopback, one for the session (tests/mailserver.py);
    each test makes its own users."""
    import mailserver

    world = mailserver.start_world()
    try:
        yield world
    finally:
        mailserver.stop_world(world)
