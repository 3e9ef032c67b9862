"""`mdclaw check-config --skip-secrets`: everything is checked except that secret files exist.

The NixOS module validates the rendered config at build time, when secrets (systemd
credentials, /run/secrets/...) do not exist yet.
"""

from __future__ import annotations

CONFIG = """\
data_dir: {data_dir}
models:
  claude: {backend: claude, model: claude-sonnet-4-5,
           api_key_file: "$CREDENTIALS_DIRECTORY/anthropic"}
assistant: {name: Andy, model: claude}
channels:
  http: {listen: "127.0.0.1:3000", secret_file: /nonexistent/mdclaw-http-token}
  telegram: {token_file: /nonexistent/mdclaw-telegram-token}
groups:
  main: {name: Admin, jid: "hl:main", main: true}
"""


def test_missing_secret_files_fail_without_flag(cli, write_config) -> None:
    r = cli("check-config", "--config", str(write_config(CONFIG)),
            env={"CREDENTIALS_DIRECTORY": "/nonexistent/creds"})
    assert r.returncode == 1
    assert "/nonexistent/creds/anthropic" in r.stderr  # $VAR expanded in the message
    assert "mdclaw-telegram-token" in r.stderr and "does not exist" in r.stderr


def test_skip_secrets_accepts_missing_files(cli, write_config) -> None:
    r = cli("check-config", "--skip-secrets", "--config", str(write_config(CONFIG)))
    assert r.returncode == 0, r.stderr
    assert "models.claude.api_key_file" in r.stdout
    assert "channels.telegram.token_file" in r.stdout


def test_skip_secrets_still_checks_everything_else(cli, write_config) -> None:
    bad = CONFIG.replace("backend: claude", "backend: clod").replace("listen: \"127.0.0.1:3000\"",
                                                                      "listen: nowhere")
    r = cli("check-config", "--skip-secrets", "--config", str(write_config(bad)))
    assert r.returncode == 1
    assert "models.claude.backend" in r.stderr and "channels.http.listen" in r.stderr
    assert "does not exist" not in r.stderr


def test_secret_files_are_checked_by_their_own_pass(tmp_path) -> None:
    """Loading takes the path (expanded) without looking at the file; the one pass that
    looks (check-config without --skip-secrets, doctor, the daemon) says what is wrong, at
    the key's line."""
    from mdclaw.config import key_lines, load_config, secret_file_issues

    text = f"data_dir: {tmp_path}\nchannels: {{telegram: {{token_file: /nonexistent/t}}}}\n"
    cfg = load_config(tmp_path / "c.yaml", text=text)
    assert str(cfg.channels.telegram.token_file) == "/nonexistent/t"
    issues = secret_file_issues(cfg, key_lines(text))
    assert [(i.path, i.line) for i in issues] == [("channels.telegram.token_file", 2)]
    assert "does not exist" in issues[0].message


def test_skip_host_checks_leaves_out_the_checks_beyond_the_schema(write_config, capsys) -> None:
    import argparse

    from mdclaw.commands.core import CONFIG_CHECKS, cmd_check_config, register

    def looks_at_this_machine(cfg):
        yield "groups.main.mounts.0: mount refused: host path '/srv/x' does not exist"

    parser = argparse.ArgumentParser()
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config")
    register(parser.add_subparsers(), common)
    path = str(write_config())
    CONFIG_CHECKS.append(looks_at_this_machine)
    try:
        assert cmd_check_config(parser.parse_args(["check-config", "--config", path])) == 1
        assert "/srv/x" in capsys.readouterr().err
        args = parser.parse_args(["check-config", "--skip-host-checks", "--config", path])
        assert cmd_check_config(args) == 0
        assert "config ok" in capsys.readouterr().out
    finally:
        CONFIG_CHECKS.remove(looks_at_this_machine)
