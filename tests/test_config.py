"""Config validation: the valid example, and one test per class of error."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from mdclaw.config import (
    ConfigError,
    check_secret_files,
    find_config_path,
    load_config,
    parse_duration,
)

REPO = Path(__file__).resolve().parent.parent


def errors_of(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    return [i.render(str(path)) for i in ei.value.issues]


def secret_errors_of(path: Path) -> list[str]:
    """The secret files' problems, as check-config and the daemon report them: loading the
    config takes the paths; the secret pass looks at the files."""
    cfg = load_config(path)
    with pytest.raises(ConfigError) as ei:
        check_secret_files(cfg, path)
    return [i.render(str(path)) for i in ei.value.issues]


def test_example_config_is_valid() -> None:
    cfg = load_config(REPO / "config.example.yaml")
    assert cfg.main_folder == "main"
    assert cfg.groups["family"].timeout == timedelta(minutes=10)
    assert cfg.groups["family"].effective_requires_trigger() is True
    assert cfg.groups["main"].effective_requires_trigger() is False


def test_issue_example_loads(write_config) -> None:
    p = write_config("""\
        data_dir: {data_dir}
        assistant: {name: Andy, timezone: Europe/Berlin}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true, requires_trigger: false}
          family:
            name: Family
            jid: "tg:-1001234"
            trigger: "@Andy"
            mounts:
              - {host: /srv/photos, container: photos, readonly: true}
            timeout: 10m
        limits: {max_concurrent_containers: 5}
    """)
    cfg = load_config(p)
    fam = cfg.groups["family"]
    assert fam.mounts[0].host == "/srv/photos" and fam.mounts[0].readonly
    assert cfg.limits.max_concurrent_containers == 5
    assert cfg.assistant.timezone == "Europe/Berlin"
    assert fam.effective_trigger(cfg.assistant) == "@Andy"
    assert cfg.groups["main"].effective_trigger(cfg.assistant) == "@Andy"


@pytest.mark.parametrize("text,expected", [
    ("90s", timedelta(seconds=90)), ("10m", timedelta(minutes=10)), ("1h", timedelta(hours=1)),
    (1500, timedelta(milliseconds=1500)), ("250ms", timedelta(milliseconds=250)),
    ("2d", timedelta(days=2)),
])
def test_durations(text, expected) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["10x", "", "-5s", 0, -3, "1h30", True])
def test_bad_durations(bad) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_unknown_key_names_path_line_and_suggestion(write_config) -> None:
    p = write_config("""\
        data_dir: {data_dir}
        groups:
          main:
            name: A
            jid: "tg:1"
            main: true
            requires_triger: false
    """)
    errs = errors_of(p)
    assert len(errs) == 1
    assert f"{p}:7:" in errs[0]
    assert "groups.main.requires_triger" in errs[0]
    assert "did you mean 'requires_trigger'" in errs[0]


def test_unknown_top_level_key_suggests(write_config) -> None:
    errs = errors_of(write_config("data_dri: /tmp/x\n"))
    assert "unknown key 'data_dri'" in errs[0] and "did you mean 'data_dir'" in errs[0]
    assert ":1:" in errs[0]


def test_invalid_yaml_points_at_line(write_config) -> None:
    errs = errors_of(write_config("groups:\n  main: {name: x\n  other: 1\n"))
    assert "invalid YAML" in errs[0]
    assert ":3:" in errs[0] or ":2:" in errs[0]


def test_wrong_type(write_config) -> None:
    errs = errors_of(write_config("limits:\n  max_concurrent_containers: five\n"))
    assert "limits.max_concurrent_containers" in errs[0] and "'five'" in errs[0]
    assert ":2:" in errs[0]


def test_two_main_groups(write_config) -> None:
    errs = errors_of(p := write_config("""\
        groups:
          a: {name: A, jid: "x:1", main: true}
          b: {name: B, jid: "x:2", main: true}
    """))
    assert errs == [f"{p}:3: groups.b.main: exactly one group must have main: true; 'a' and "
                    "'b' have it: keep it on the admin group only"]


def test_no_main_group(write_config) -> None:
    errs = errors_of(write_config('groups:\n  a: {name: A, jid: "x:1"}\n'))
    assert "groups: exactly one group must have main: true; found 0" in errs[0]
    assert ":1:" in errs[0]


@pytest.mark.parametrize("folder", ["-bad", "has space", "a" * 65, "global", "errors", "dots.x",
                                    "../up"])
def test_bad_folder_names(write_config, folder) -> None:
    errs = errors_of(write_config(f"""\
        groups:
          main: {{name: A, jid: "x:1", main: true}}
          "{folder}": {{name: B, jid: "x:2"}}
    """))
    assert any(repr(folder) in e for e in errs), errs


@pytest.mark.parametrize("second", ["FAMILY", "Family", "Main"])
def test_folders_differing_only_in_case_are_refused(write_config, cli, second) -> None:
    """On a case-insensitive file system (macOS) `family` and `FAMILY` are one folder."""
    path = write_config(f"""\
        groups:
          main: {{name: A, jid: "x:1", main: true}}
          family: {{name: B, jid: "x:2"}}
          "{second}": {{name: C, jid: "x:3"}}
    """)
    first = "main" if second == "Main" else "family"
    errs = errors_of(path)
    (err,) = [e for e in errs if "but for case" in e]
    assert f"groups.{second}: '{second}' is the folder of group '{first}' but for case" in err
    assert ":4:" in err and "casefold()" in err and "rename one of the two" in err
    r = cli("check-config", "--config", str(path))
    assert r.returncode == 1 and "but for case" in r.stderr


def test_unknown_timezone(write_config) -> None:
    errs = errors_of(write_config("assistant:\n  timezone: Mars/Olympus\n"))
    assert "assistant.timezone" in errs[0] and "Mars/Olympus" in errs[0] and ":2:" in errs[0]


def test_duplicate_jid_and_duplicate_key(write_config) -> None:
    errs = errors_of(write_config("""\
        groups:
          main: {name: A, jid: "x:1", main: true}
          b: {name: B, jid: "x:1"}
    """))
    assert "groups.b.jid: 'x:1' is also the jid of group 'main'" in errs[0] and ":3:" in errs[0]
    errs = errors_of(write_config("data_dir: /a\ndata_dir: /b\n"))
    assert "appears twice" in errs[0] and ":2:" in errs[0]


def test_every_error_is_listed(write_config) -> None:
    errs = errors_of(write_config("""\
        assistant: {timezone: Nowhere/City, nmae: x}
        limits: {max_concurrent_containers: 0, idle_timeout: abc}
    """))
    assert len(errs) >= 3


def test_idle_timeout_must_be_below_hard_timeout(write_config) -> None:
    errs = errors_of(write_config("limits: {container_timeout: 5m, idle_timeout: 10m}\n"))
    assert "limits.idle_timeout: idle_timeout (10m) must be shorter than container_timeout " \
        "(5m)" in errs[0]


def test_secret_file_missing(write_config, tmp_path) -> None:
    errs = secret_errors_of(write_config(
        f"channels:\n  telegram:\n    token_file: {tmp_path}/nope\n"))
    assert "channels.telegram.token_file" in errs[0] and "does not exist" in errs[0]


def test_secret_file_world_readable_is_refused_and_content_never_shown(write_config,
                                                                      tmp_path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cr3t-VALUE-123\n")
    os.chmod(secret, 0o644)
    p = write_config(f"channels:\n  telegram:\n    token_file: {secret}\n")
    errs = secret_errors_of(p)
    assert "readable by every user" in errs[0] and "chmod o-rwx" in errs[0]
    assert all("s3cr3t" not in e for e in errs)
    os.chmod(secret, 0o600)
    cfg = load_config(p)
    assert cfg.channels.telegram.token_file == secret
    assert "s3cr3t" not in repr(cfg) and "s3cr3t" not in cfg.model_dump_json()


def test_env_overrides(write_config, monkeypatch, tmp_path) -> None:
    p = write_config()
    monkeypatch.setenv("MDCLAW_DATA_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("MDCLAW_ASSISTANT__NAME", "Bob")
    cfg = load_config(p)
    assert cfg.data_dir == tmp_path / "elsewhere"
    assert cfg.assistant.name == "Bob"
    assert cfg.assistant.timezone == "Europe/Berlin"  # the rest of the section is kept
    assert cfg.groups["family"].trigger == "@Andy"


def test_config_is_frozen(write_config) -> None:
    cfg = load_config(write_config())
    with pytest.raises(ValidationError):
        cfg.assistant.name = "x"  # type: ignore[misc]


def test_config_path_resolution(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert find_config_path("/x/y.yaml") == Path("/x/y.yaml")
    monkeypatch.setenv("MDCLAW_CONFIG", "/from/env.yaml")
    assert find_config_path(None) == Path("/from/env.yaml")
    monkeypatch.delenv("MDCLAW_CONFIG")
    (tmp_path / "config.yaml").write_text("{}")
    assert find_config_path(None) == Path("config.yaml")
    (tmp_path / "config.yaml").unlink()
    assert find_config_path(None) in (Path("/etc/mdclaw/config.yaml"), Path("config.yaml"))


def test_missing_file(tmp_path) -> None:
    errs = errors_of(tmp_path / "absent.yaml")
    assert "not found" in errs[0]


def test_task_schedule_errors_are_config_errors(write_config) -> None:
    errs = errors_of(write_config("""\
        groups:
          main: {name: A, jid: "x:1", main: true}
        tasks:
          - {id: t1, group: main, prompt: hi, cron: "61 * * * *"}
          - {id: t2, group: nope, prompt: hi, interval: 1h}
    """))
    assert len(errs) == 2
    assert ":4: tasks.0.cron: cron expression '61 * * * *' is not valid" in errs[0]
    assert ":5: tasks.1.group: 'nope' is not in groups (known: main)" in errs[1]
    errs = errors_of(write_config("""\
        groups:
          main: {name: A, jid: "x:1", main: true}
        tasks:
          - {id: t3, group: main, prompt: hi, cron: "0 8 * * *", interval: 1h}
    """))
    assert "tasks.0.interval: give exactly one of cron, interval, once" in errs[0]
    assert ":4:" in errs[0]


def test_relative_data_dir_is_relative_to_the_config_file(tmp_path, monkeypatch) -> None:
    sub = tmp_path / "etc"
    sub.mkdir()
    p = sub / "config.yaml"
    p.write_text("data_dir: ./state\n")
    monkeypatch.chdir(tmp_path)
    assert load_config(p).data_dir == sub / "state"
    assert load_config(REPO / "config.example.yaml").data_dir == REPO / "data"


@pytest.mark.parametrize("session", ["groups/main/wa.sqlite3", "ipc/main/s.db",
                                     "{data_dir}/sessions/main/s.db"])
def test_whatsapp_session_file_never_in_a_container_tree(write_config, session) -> None:
    """The session file holds the linked device's keys: a path in a folder an agent can
    reach (relative to data_dir or absolute) is refused at its key; the default is fine."""
    base = """\
        data_dir: {data_dir}
        groups:
          main: {name: Main, jid: "hl:main", main: true}
        channels:
          whatsapp: {enabled: true%s}
    """
    errs = errors_of(write_config(base % f", session_file: {session!r}"))
    assert len(errs) == 1 and "channels.whatsapp.session_file" in errs[0], errs
    assert "linked device's keys" in errs[0]
    cfg = load_config(write_config(base % ", session_file: whatsapp/keys.sqlite3"))
    assert cfg.whatsapp_session_path == cfg.data_dir / "whatsapp" / "keys.sqlite3"


def test_may_ask_names_other_groups(write_config) -> None:
    errs = errors_of(write_config("""\
        groups:
          main: {name: A, jid: "x:1", main: true, may_ask: [main, research, nope]}
          research: {name: R, jid: "x:2"}
    """))
    assert len(errs) == 2, errs
    assert ("groups.main.may_ask.0: 'main' is this group itself: an agent does not ask "
            "itself; remove it") in errs[0]
    assert "groups.main.may_ask.2: 'nope' is not in groups (known: main, research)" in errs[1]
