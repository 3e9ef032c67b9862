"""`mdclaw check-config`: one problem per line, at the line of the key it is about, sorted by
line then key path, every problem at once (cross-key ones too, also beside keys that are wrong
on their own), and the same list as JSON with --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from mdclaw.config import Config, ConfigError, load_config

# Line numbers are those of the file as written (write_config dedents nothing here).
SEVERAL = """\
data_dir: {data_dir}
assistant:
  name: Andy
  model: ghost
models:
  local: {backend: openai, model: llama3, base_url: "http://127.0.0.1:11434/v1"}
groups:
  main:
    name: Admin
    jid: "tg:1"
    main: true
  family:
    name: Family
    jid: "tg:1"
    model: gpt9
  club:
    name: Club
    jid: "tg:3"
    main: true
tasks:
  - {id: t1, group: nowhere, prompt: hi, interval: 1h}
  - id: t1
    group: main
    prompt: hi
    cron: "61 * * * *"
"""

EXPECTED = [  # (line, path, start of the message)
    (4, "assistant.model", "'ghost' is not in models (known: local): name one of them or add"),
    (14, "groups.family.jid", "'tg:1' is also the jid of group 'main'"),
    (15, "groups.family.model", "'gpt9' is not in models (known: local)"),
    (19, "groups.club.main", "exactly one group must have main: true; 'main' and 'club' have it"),
    (21, "tasks.0.group", "'nowhere' is not in groups (known: club, family, main)"),
    (22, "tasks.1.id", "'t1' is the id of an earlier task too: give each task its own id"),
    (25, "tasks.1.cron", "cron expression '61 * * * *' is not valid"),
]


def _check(lines: list[str], file: Path, expected: list[tuple[int, str, str]]) -> None:
    assert len(lines) == len(expected), lines
    for text, (line, path, message) in zip(lines, expected, strict=True):
        assert text.startswith(f"{file}:{line}: {path}: {message}"), (text, line, path)


def test_several_cross_key_problems_one_line_each_sorted(cli, write_config) -> None:
    path = write_config(SEVERAL)
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 1
    head, *lines = r.stderr.splitlines()
    assert head == f"mdclaw: invalid config {path} (7 errors):"
    _check([x.strip() for x in lines], path, EXPECTED)
    assert r.stdout == ""


def test_json_lists_the_same_issues(cli, write_config) -> None:
    path = write_config(SEVERAL)
    r = cli("check-config", "--json", "--config", str(path))
    assert r.returncode == 1
    issues = json.loads(r.stdout)
    assert [(i["line"], i["path"]) for i in issues] == [(n, p) for n, p, _ in EXPECTED]
    for issue, (_, _, message) in zip(issues, EXPECTED, strict=True):
        assert set(issue) == {"file", "line", "path", "message", "severity"}
        assert issue["file"] == str(path) and issue["severity"] == "error"
        assert issue["message"].startswith(message)
    text = cli("check-config", "--config", str(path)).stderr.splitlines()[1:]
    assert [x.strip() for x in text] == [
        f"{i['file']}:{i['line']}: {i['path']}: {i['message']}" for i in issues]


def test_keys_wrong_on_their_own_do_not_hide_the_cross_key_problems(write_config) -> None:
    path = write_config("""\
data_dir: /tmp/x
assistant:
  timezone: Mars/Olympus
groups:
  main: {name: Admin, jid: "tg:1", main: true}
  family: {name: Family, jid: "tg:2", timeout: forever, main: true}
  club: {name: Club, jid: "tg:1"}
tasks:
  - {id: t1, group: family, prompt: hi, interval: 1h}
  - {id: t2, group: nowhere, prompt: hi, interval: 10ms}
limits: {container_timeout: 5m, idle_timeout: 10m}
""")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    got = [(i.line, i.path) for i in e.value.issues]
    assert got == [
        (3, "assistant.timezone"),
        (6, "groups.family.main"),     # main too, though its timeout is wrong
        (6, "groups.family.timeout"),
        (7, "groups.club.jid"),
        (10, "tasks.1.group"),
        (10, "tasks.1.interval"),      # too short
        (11, "limits.idle_timeout"),
    ]
    # Nothing that depends on an entry in error: t1's group 'family' is there (if wrong).
    assert not any(i.path == "tasks.0.group" for i in e.value.issues)
    msgs = {i.path: i.message for i in e.value.issues}
    assert "'main' and 'family' have it" in msgs["groups.family.main"]
    assert "(known: club, family, main)" in msgs["tasks.1.group"]


def test_a_model_with_an_error_is_still_a_known_name(write_config) -> None:
    path = write_config("""\
models:
  broken: {backend: nope, model: x}
groups:
  main: {name: A, jid: "tg:1", main: true, model: broken}
  b: {name: B, jid: "tg:2", model: other}
""")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert [(i.line, i.path) for i in e.value.issues] == [
        (2, "models.broken.backend"), (5, "groups.b.model")]
    assert "'other' is not in models (known: broken)" in e.value.issues[1].message


def test_warnings_and_host_checks_are_sorted_in_and_leave_the_status(cli, write_config,
                                                                    tmp_path: Path) -> None:
    path = write_config(f"""\
data_dir: {tmp_path / 'data'}
groups:
  main:
    name: Admin
    jid: "tg:-1001234567890"
    main: true
""")
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 0, r.stderr
    assert "config ok" in r.stdout
    assert r.stderr.splitlines()[0] == f"mdclaw: config {path} is valid, with 1 warning:"
    assert f"{path}:3: warning: groups.main: the main group answers in" in r.stderr
    r = cli("check-config", "--json", "--config", str(path))
    assert r.returncode == 0
    (issue,) = json.loads(r.stdout)
    assert issue["severity"] == "warning" and issue["line"] == 3
    assert issue["path"] == "groups.main"
    # A refused mount (a check beyond the schema) is an error at its own line, sorted in.
    path.write_text(path.read_text() + "    mounts:\n      - {host: /etc, container: etc}\n")
    r = cli("check-config", "--json", "--config", str(path))
    assert r.returncode == 1
    issues = json.loads(r.stdout)
    assert [(i["line"], i["path"], i["severity"]) for i in issues] == [
        (3, "groups.main", "warning"), (8, "groups.main.mounts.0", "error")]
    assert issues[1]["message"].startswith("mount refused:")


def test_valid_config_json_is_an_empty_list(cli, write_config) -> None:
    r = cli("check-config", "--json", "--config", str(write_config()))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_file_problems_are_issues_too(cli, tmp_path: Path) -> None:
    r = cli("check-config", "--json", "--config", str(tmp_path / "absent.yaml"))
    assert r.returncode == 1
    (issue,) = json.loads(r.stdout)
    assert issue["line"] is None and issue["path"] == "" and "not found" in issue["message"]


def test_constructing_a_config_directly_still_refuses_cross_key_problems(tmp_path) -> None:
    with pytest.raises(ValidationError, match="groups.b.main: exactly one group"):
        Config(data_dir=tmp_path, groups={"a": {"name": "A", "jid": "x:1", "main": True},
                                          "b": {"name": "B", "jid": "x:2", "main": True}})
