"""The agent runner's copy of the IPC command schema is the host's, regenerated.

container/agent-runner/mdclaw_agent/commands_schema.json is generated from the pydantic models
in mdclaw/ipc/protocol.py (the runner cannot import mdclaw); its tools take command types,
fields, enums and limits from it. These tests regenerate it in memory and fail when the
committed file differs, and check that the runner's package ships it.
"""

from __future__ import annotations

import json
import tomllib

import pytest

import agent_helpers  # noqa: F401 - puts the runner package on sys.path
from conftest import REPO
from mdclaw.commands.schema import COMMAND_SCHEMA_PATH, render_json
from mdclaw.ipc import protocol

REGENERATE = f"regenerate it: python -m mdclaw command-schema > {COMMAND_SCHEMA_PATH}"


def assert_fresh(committed: str) -> None:
    """Fail, naming the first differing line, unless `committed` is what the models give."""
    generated = render_json(protocol.command_json_schema())
    if committed == generated:
        return
    pairs = zip(committed.splitlines(), generated.splitlines(), strict=False)
    for n, (a, b) in enumerate(pairs, 1):
        if a != b:
            where = f"line {n}: committed {a.strip()!r}, models give {b.strip()!r}"
            break
    else:
        where = "the files differ in length"
    raise AssertionError(f"{COMMAND_SCHEMA_PATH} is stale ({where}); {REGENERATE}")


def test_committed_command_schema_is_current() -> None:
    assert_fresh((REPO / COMMAND_SCHEMA_PATH).read_text(encoding="utf-8"))


def test_a_planted_difference_is_caught() -> None:
    current = render_json(protocol.command_json_schema())
    assert_fresh(current)
    assert '"maxLength": 65536' in current
    planted = current.replace('"maxLength": 65536', '"maxLength": 65535', 1)
    with pytest.raises(AssertionError, match=r"stale \(line \d+: committed '\"maxLength\": "
                                             r"65535,', models give '\"maxLength\": 65536,'"):
        assert_fresh(planted)
    # A command the host knows and the file does not.
    body = json.loads(current)
    del body["discriminator"]["mapping"]["react"]
    with pytest.raises(AssertionError, match="stale"):
        assert_fresh(render_json(body))


def test_the_cli_prints_the_committed_file(cli) -> None:
    r = cli("command-schema")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (REPO / COMMAND_SCHEMA_PATH).read_text(encoding="utf-8"), REGENERATE


def test_the_runner_reads_the_hosts_schema() -> None:
    from mdclaw_agent import commands

    assert commands.SCHEMA == protocol.command_json_schema()
    assert set(commands.COMMAND_TYPES) == set(protocol.COMMAND_TYPES)
    assert commands.MAX_FILE_BYTES == protocol.SEND_FILE_MAX_BYTES
    assert commands.enum("schedule_task", "schedule_type") == ("cron", "interval", "once")
    assert commands.fields("update_task") == tuple(
        k for k in protocol.UpdateTask.model_fields if k != "type")
    assert commands.field("message", "text") == {"type": "string", "minLength": 1,
                                                 "maxLength": protocol.MAX_TEXT}


def test_the_runner_package_ships_the_schema() -> None:
    """setuptools (the flake's mdclaw-agent-runner) installs only declared data files; the
    Dockerfile copies the whole package directory."""
    runner = REPO / "container" / "agent-runner"
    data = tomllib.loads((runner / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["mdclaw_agent"]
    package = runner / "mdclaw_agent"
    shipped = {p.name for pattern in data for p in package.glob(pattern)}
    others = {p.name for p in package.iterdir() if p.is_file() and p.suffix != ".py"}
    assert "commands_schema.json" in shipped
    assert others <= shipped, f"declare these in package-data: {sorted(others - shipped)}"
    dockerfile = (REPO / "container" / "Dockerfile").read_text()
    assert "COPY container/agent-runner/mdclaw_agent/ /opt/mdclaw/lib/mdclaw_agent/" in dockerfile
