"""Settings whose optional dependency (a pyproject extra) is not installed: every subcommand
of `mdclaw`, found by walking the CLI's parser, run in a subprocess on a config with
`channels.whatsapp`, `channels.email` and `transcription.provider: local` while neonize,
imapclient and faster-whisper cannot be imported. None ends in a traceback; those that need
an extra fail naming it and the fix; `mdclaw run` starts anyway, without the WhatsApp and
email channels, and says why.

Also the CLI's last resort: an MdclawError no command caught ends in one line (its traceback
with MDCLAW_DEBUG=1), and any other exception, a bug, keeps its traceback."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mdclaw.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent
BLOCKED = ("neonize", "faster_whisper", "imapclient")
# Runs mdclaw's CLI with the optional modules unimportable (`import neonize` raises).
WRAPPER = ("import sys\n"
           f"for name in {BLOCKED!r}:\n"
           "    sys.modules[name] = None\n"
           "from mdclaw.cli import main\n"
           "sys.exit(main(sys.argv[1:]))\n")
# What each subcommand's required arguments get (a new one must be added here).
ARGUMENTS = {"task_id": ["t1"], "row_id": ["1"], "name": ["main.tasks.x.json.error"],
             "tarball": ["/nonexistent/image.tar"], "text": ["hello"], "group": ["main"],
             "channel": ["telegram"], "sender": ["12345"], "id": ["1"],
             "archive": ["/nonexistent/backup.tar.zst"], "dir": ["/nonexistent/nanoclaw"],
             "server": ["time"], "tool": ["get_current_time"], "arguments": ["{}"]}
# Subcommands that need an extra, and the extras their failure names.
NEEDS = {("check-config",): {"whatsapp", "transcribe", "email"},
         ("doctor",): {"whatsapp", "transcribe", "email"}, ("whatsapp", "link"): {"whatsapp"}}


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> list[tuple[tuple[str, ...], list[str]]]:
    """(command words, their required arguments) for every leaf of the parser."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        args: list[str] = []
        for a in parser._actions:
            if isinstance(a, argparse._HelpAction) or not (a.required or not a.option_strings):
                continue
            if a.dest not in ARGUMENTS:
                raise AssertionError(f"`mdclaw {' '.join(path)}` has a required argument "
                                     f"{a.dest!r}: add a value for it to ARGUMENTS")
            args += ([a.option_strings[0]] if a.option_strings else []) + ARGUMENTS[a.dest]
        return [(path, args)]
    out = []
    seen: set[int] = set()
    for group in groups:
        for name, sub in group.choices.items():
            if id(sub) not in seen:  # an alias names the same parser
                seen.add(id(sub))
                out += subcommands(sub, path + (name,))
    return out


@pytest.fixture
def extras_config(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "config.yaml"
    password = tmp_path / "mail.password"
    password.write_text("secret\n")
    password.chmod(0o600)
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\n"
                   "groups: {main: {name: Main, jid: 'hl:main', main: true}}\n"
                   "server: {listen: '127.0.0.1:0'}\n"
                   "channels: {http: {enabled: true}, whatsapp: {enabled: true},\n"
                   "  email: {address: bot@example.org, imap_host: 127.0.0.1, imap_port: 9,\n"
                   "          smtp_host: 127.0.0.1, smtp_port: 9, authserv_id: mx.example.org,\n"
                   f"          password_file: {password}}}}}\n"
                   "transcription: {provider: local}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(MDCLAW_CONFIG=str(cfg), PYTHONPATH=str(REPO), HOME=str(tmp_path),
               DOCKER_HOST="unix:///nonexistent/mdclaw-test-no-engine.sock")
    return env


@pytest.mark.slow
def test_every_subcommand_ends_without_a_traceback_and_names_the_extra(
        extras_config: dict[str, str]) -> None:
    commands = subcommands(build_parser())
    assert len(commands) >= 30 and (("run",), []) in commands
    seen_needs = set()
    for words, args in commands:
        if words == ("run",):
            continue  # below: it runs until stopped
        # In HOME (the test's folder): a command may write there (`export`'s zip).
        r = subprocess.run([sys.executable, "-c", WRAPPER, *words, *args], env=extras_config,
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                           cwd=extras_config["HOME"])
        shown = f"mdclaw {' '.join(words + tuple(args))} -> {r.returncode}\n{r.stdout}{r.stderr}"
        assert "Traceback" not in r.stderr + r.stdout, shown
        if r.returncode != 0:
            assert (r.stderr + r.stdout).strip(), shown  # it says why
        needs = NEEDS.get(words)
        if needs:
            seen_needs.add(words)
            assert r.returncode != 0, shown
            for extra in needs:
                assert f"pip install 'mdclaw[{extra}]'" in r.stdout + r.stderr, shown
            if words != ("doctor",):  # doctor reports on stdout, its checks one a line
                assert r.stderr.strip().splitlines()[-1].startswith(("mdclaw:", "  ")), shown
    assert seen_needs == set(NEEDS)


@pytest.mark.slow
def test_the_daemon_runs_without_the_extras_and_says_why(extras_config: dict[str, str]
                                                          ) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, "run"], env=extras_config,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    rest = ""
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if " ready: " in line:
                break
        assert any(" ready: " in line for line in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log
    assert "Traceback" not in log
    assert "channel whatsapp did not start: the WhatsApp channel needs neonize" in log
    assert "pip install 'mdclaw[whatsapp]'" in log
    assert "channel email did not start: the email channel needs imapclient" in log
    assert "pip install 'mdclaw[email]'" in log


def test_an_uncaught_mdclaw_error_is_one_line_and_a_bug_keeps_its_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mdclaw.commands import schema
    from mdclaw.errors import StateError

    def fails(args: argparse.Namespace) -> int:
        raise StateError("the outbox row 7 is gone;\nlook again with `mdclaw outbox list`")

    monkeypatch.setattr(schema, "cmd_config_schema", fails)
    monkeypatch.delenv("MDCLAW_DEBUG", raising=False)
    assert main(["config-schema"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == ["mdclaw: the outbox row 7 is gone; look again with `mdclaw "
                                "outbox list` (MDCLAW_DEBUG=1 shows where it came from)"]
    monkeypatch.setenv("MDCLAW_DEBUG", "1")
    assert main(["config-schema"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in fails" in err
    assert err.splitlines()[-1] == ("mdclaw: the outbox row 7 is gone; look again with "
                                    "`mdclaw outbox list`")

    def bug(args: argparse.Namespace) -> int:
        raise KeyError("not mdclaw's own")

    monkeypatch.setattr(schema, "cmd_config_schema", bug)
    with pytest.raises(KeyError):
        main(["config-schema"])


def test_which_settings_need_which_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    from mdclaw.config import EXTRAS, load_config, missing_extras
    from mdclaw.config.extras import fix_for

    for name in BLOCKED:
        monkeypatch.setitem(sys.modules, name, None)

    def missing(extra_yaml: str) -> list[tuple[str, str]]:
        cfg = load_config(tmp_path / "c.yaml", text=f"data_dir: {tmp_path}\n{extra_yaml}")
        return [(m.key, m.extra.name) for m in missing_extras(cfg, load=True)]

    assert missing("") == []
    assert missing("channels: {whatsapp: {enabled: false}}\n") == []
    assert missing("transcription: {provider: openai}\n") == []
    assert missing("channels: {whatsapp: {}}\ntranscription: {provider: local}\n") == [
        ("channels.whatsapp", "whatsapp"), ("transcription.provider", "transcribe")]
    email = ("channels: {email: {address: a@example.org, imap_host: h, smtp_host: h, "
             f"password_file: {tmp_path / 'pw'}, authserv_id: mx.example.org%s}}}}\n")
    assert missing(email % "") == [("channels.email", "email")]
    assert missing(email % ", enabled: false") == []
    monkeypatch.setitem(sys.modules, "slack_bolt", None)
    assert missing("channels: {slack: {bot_token_file: /b, app_token_file: /a}}\n") == [
        ("channels.slack", "slack")]
    assert missing("channels: {slack: {enabled: false, bot_token_file: /b, "
                   "app_token_file: /a}}\n") == []
    # from the Nix store pip cannot help: what the package offers instead
    assert "pip install 'mdclaw[whatsapp]'" in fix_for(EXTRAS["whatsapp"], nix=False)
    assert "Telegram or the local chat" in fix_for(EXTRAS["whatsapp"], nix=True)
    assert "provider: openai" in fix_for(EXTRAS["transcribe"], nix=True)
    assert "pip install 'mdclaw[slack]'" in fix_for(EXTRAS["slack"], nix=False)
    assert "flake's package brings slack-bolt" in fix_for(EXTRAS["slack"], nix=True)


def test_the_slack_channel_without_its_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from mdclaw.channels.base import ChannelError
    from mdclaw.channels.slack import SlackChannel

    # Unimportable, also where another test imported it already.
    for name in [n for n in sys.modules if n.startswith("slack_bolt.")] + ["slack_bolt"]:
        monkeypatch.setitem(sys.modules, name, None)
    ch = SlackChannel("xoxb-1", "xapp-1")
    with pytest.raises(ChannelError, match=r"needs slack-bolt.*mdclaw\[slack\]") as e:
        asyncio.run(ch.connect())
    assert e.value.permanent and not ch.is_connected()


def test_the_chromium_a_setting_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      cli) -> None:  # noqa: ANN001
    """ha_capture_screenshot's browser is a program, not an extra: check-config refuses a
    `chromium:` that is not there; doctor warns when none is found (fails a named one)."""
    from mdclaw.ops import doctor

    token = tmp_path / "ha.token"
    token.write_text("t\n")
    token.chmod(0o600)
    fake = tmp_path / "bin" / "chromium"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)

    def config(chromium: str | None) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(f"data_dir: {tmp_path / 'data'}\n"
                        "groups: {main: {name: Main, jid: 'hl:main', main: true}}\n"
                        "integrations:\n  home_assistant:\n    url: http://127.0.0.1:9\n"
                        f"    token_file: {token}\n"
                        + (f"    chromium: {chromium}\n" if chromium else ""))
        return path

    monkeypatch.setenv("PATH", str(fake.parent))
    r = cli("check-config", "--config", str(config("/nonexistent/chromium")))
    assert r.returncode == 1
    assert ("integrations.home_assistant.chromium: '/nonexistent/chromium' is not a program "
            "on PATH") in r.stderr
    assert cli("check-config", "--config", str(config(str(fake)))).returncode == 0

    def chromium_check(path: Path) -> dict[str, str]:
        (c,) = [c for c in doctor.run_checks(str(path)) if c["check"] == "chromium"]
        return c

    assert chromium_check(config(None))["level"] == "ok"  # found on PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    c = chromium_check(config(None))
    assert c["level"] == "warn" and "no Chromium found" in c["detail"]
    assert "pkgs.chromium" in c["fix"]
    assert chromium_check(config("/nonexistent/chromium"))["level"] == "fail"
