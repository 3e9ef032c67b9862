"""The agent runner's copy of the wire contract is the host's, regenerated.

container/agent-runner/mdclaw_agent/wire_schema.json is generated from the pydantic models in
mdclaw/wire.py (the runner cannot import mdclaw); the runner checks its stdin and its output
blocks against it and takes the input's defaults, the markers, the backends and the causes
from it. These tests regenerate it in memory and fail when the committed file differs, and
check that the runner's package and both images ship it.
"""

from __future__ import annotations

import json
import re
import tomllib

import pytest

import agent_helpers  # noqa: F401 - puts the runner package on sys.path
from conftest import REPO
from mdclaw.commands.schema import WIRE_SCHEMA_PATH, render_json
from mdclaw.wire import wire_json_schema

REGENERATE = f"regenerate it: python -m mdclaw wire-schema > {WIRE_SCHEMA_PATH}"


def assert_fresh(committed: str) -> None:
    """Fail, naming the first differing line, unless `committed` is what the models give."""
    generated = render_json(wire_json_schema())
    if committed == generated:
        return
    pairs = zip(committed.splitlines(), generated.splitlines(), strict=False)
    for n, (a, b) in enumerate(pairs, 1):
        if a != b:
            where = f"line {n}: committed {a.strip()!r}, models give {b.strip()!r}"
            break
    else:
        where = "the files differ in length"
    raise AssertionError(f"{WIRE_SCHEMA_PATH} is stale ({where}); {REGENERATE}")


def test_committed_wire_schema_is_current() -> None:
    assert_fresh((REPO / WIRE_SCHEMA_PATH).read_text(encoding="utf-8"))


def test_a_planted_difference_is_caught() -> None:
    current = render_json(wire_json_schema())
    assert_fresh(current)
    # Another default on one side.
    assert '"default": "Andy"' in current
    with pytest.raises(AssertionError, match=r"stale \(line \d+: committed '\"default\": "
                                             r"\"Bob\",', models give '\"default\": \"Andy\",'"):
        assert_fresh(current.replace('"default": "Andy"', '"default": "Bob"', 1))
    # A field the host has and the file does not.
    body = json.loads(current)
    del body["$defs"]["OutputBlock"]["properties"]["retryAfter"]
    with pytest.raises(AssertionError, match="stale"):
        assert_fresh(render_json(body))


def test_the_cli_prints_the_committed_file(cli) -> None:
    r = cli("wire-schema")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / WIRE_SCHEMA_PATH).read_text(encoding="utf-8"), REGENERATE


def test_the_runner_reads_the_committed_file() -> None:
    from mdclaw_agent import protocol

    assert protocol.WIRE_SCHEMA_FILE == REPO / WIRE_SCHEMA_PATH
    assert protocol.WIRE == wire_json_schema()


def test_the_runner_package_and_the_images_ship_the_schema() -> None:
    """The wheel (and the flake's mdclaw-agent-runner, built with setuptools) installs only
    declared data files; the Dockerfile copies the whole package directory."""
    runner = REPO / "container" / "agent-runner"
    data = tomllib.loads((runner / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["mdclaw_agent"]
    package = runner / "mdclaw_agent"
    assert "wire_schema.json" in {p.name for pattern in data for p in package.glob(pattern)}
    dockerfile = (REPO / "container" / "Dockerfile").read_text()
    assert "COPY container/agent-runner/mdclaw_agent/ /opt/mdclaw/lib/mdclaw_agent/" in dockerfile
    flake = (REPO / "flake.nix").read_text()
    assert re.search(r"src = lib\.cleanSource \./container/agent-runner;", flake)
