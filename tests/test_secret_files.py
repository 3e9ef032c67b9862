"""Secret files are checked in one explicit pass, not while the config is validated.

Loading a config takes each `*_file` secret path (expanded) without looking at the file;
`secret_file_issues` looks, and check-config, doctor and the daemon (at start and on every
reload) call it: the daemon refuses to start on a bad secret file as on an invalid config, and
a reload with one keeps the running config and says why.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from mdclaw.config import iter_secret_files, load_config, secret_file_issues
from mdclaw.daemon.core import Daemon


def secret(path: Path, mode: int = 0o600) -> Path:
    path.write_text("s3cr3t\n")
    path.chmod(mode)
    return path


def test_every_secret_key_of_the_schema_is_checked(tmp_path: Path) -> None:
    keys = ["models.m.api_key_file", "channels.http.secret_file",
            "channels.telegram.token_file", "channels.telegram.pool_token_files.0",
            "channels.telegram.pool_token_files.1", "transcription.api_key_file",
            "integrations.home_assistant.token_file", "web.search.api_key_file"]
    files = {k: tmp_path / k.replace(".", "-") for k in keys}
    p = tmp_path / "config.yaml"
    p.write_text(f"""\
data_dir: {tmp_path / "data"}
models: {{m: {{backend: openai, model: x, api_key_file: {files[keys[0]]}}}}}
channels:
  http: {{secret_file: {files[keys[1]]}}}
  telegram: {{token_file: {files[keys[2]]},
              pool_token_files: [{files[keys[3]]}, {files[keys[4]]}]}}
transcription: {{provider: openai, api_key_file: {files[keys[5]]}}}
integrations: {{home_assistant: {{url: "http://ha:8123", token_file: {files[keys[6]]}}}}}
web: {{search: {{provider: brave, api_key_file: {files[keys[7]]}}}}}
""")
    cfg = load_config(p)  # none of the files exists: loading does not look
    assert [k for k, _ in iter_secret_files(cfg)] == keys
    issues = secret_file_issues(cfg)
    assert [i.path for i in issues] == keys
    assert all("does not exist" in i.message for i in issues)
    for f in files.values():
        secret(f)
    assert secret_file_issues(cfg) == []
    files[keys[5]].chmod(0o644)
    (only,) = secret_file_issues(cfg)
    assert only.path == "transcription.api_key_file" and "chmod o-rwx" in only.message
    files[keys[5]].chmod(0o600)
    files[keys[4]].chmod(0o644)
    (only,) = secret_file_issues(cfg)
    assert only.path == "channels.telegram.pool_token_files.1"


def test_a_folder_and_an_unreadable_file_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "config.yaml"
    p.write_text(f"data_dir: {tmp_path / 'data'}\n"
                 f"channels: {{telegram: {{token_file: {tmp_path}}}}}\n")
    (issue,) = secret_file_issues(load_config(p))
    assert "is not a regular file" in issue.message
    if os.geteuid() != 0:  # root reads any file
        token = secret(tmp_path / "token", 0o200)
        p.write_text(f"data_dir: {tmp_path / 'data'}\n"
                     f"channels: {{telegram: {{token_file: {token}}}}}\n")
        (issue,) = secret_file_issues(load_config(p))
        assert "cannot be read by this user" in issue.message


def test_run_refuses_to_start_with_every_secret_problem_printed(cli, tmp_path: Path) -> None:
    open_key = secret(tmp_path / "key", 0o644)
    p = tmp_path / "config.yaml"
    p.write_text(f"""\
data_dir: {tmp_path / "data"}
models:
  m: {{backend: openai, model: x, api_key_file: {open_key}}}
channels:
  http: {{listen: "127.0.0.1:0"}}
  telegram: {{token_file: {tmp_path}/missing}}
""")
    r = cli("run", "--config", str(p), timeout=60)
    assert r.returncode == 1
    assert f"invalid config {p}" in r.stderr
    assert f"{p}:3: models.m.api_key_file: secret file '{open_key}' is readable by every " \
        f"user (mode 0644); run: chmod o-rwx {open_key}" in r.stderr
    assert f"{p}:6: channels.telegram.token_file: secret file '{tmp_path}/missing' does " \
        "not exist" in r.stderr
    assert not (tmp_path / "data" / "state.db").exists()  # refused before anything started


def test_doctor_names_the_bad_secret_file(cli, tmp_path: Path) -> None:
    p = tmp_path / "config.yaml"
    p.write_text(f"""\
data_dir: {tmp_path / "data"}
groups: {{main: {{name: A, jid: "hl:main", main: true}}}}
channels: {{http: {{secret_file: {tmp_path}/gone}}}}
runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
""")
    r = cli("doctor", "--json", "--config", str(p))
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["config"]["level"] == "ok"  # the file is valid: the secret is the problem
    check = checks["channels.http.secret_file"]
    assert check["level"] == "fail" and "does not exist" in check["detail"] and check["fix"]


def test_a_reload_with_a_bad_secret_keeps_the_running_config(tmp_path: Path) -> None:
    token = secret(tmp_path / "token")
    p = tmp_path / "config.yaml"
    text = f"""\
data_dir: {tmp_path / "data"}
assistant: {{name: Andy}}
groups: {{main: {{name: A, jid: "hl:main", main: true}}}}
runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
channels: {{http: {{listen: "127.0.0.1:0", secret_file: {token}}}}}
"""
    p.write_text(text)

    async def go() -> None:
        d = Daemon(load_config(p), str(p), drain_timeout=1)
        ready = asyncio.Event()
        d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
        task = asyncio.create_task(d.run())
        try:
            await asyncio.wait_for(ready.wait(), 30)
            running = d.cfg
            p.write_text(text.replace("name: Andy", "name: Bob"))
            token.chmod(0o644)
            assert await d.reload() is False
            assert d.cfg is running and d.cfg.assistant.name == "Andy"
            assert d.reload_error is not None
            assert f"{p}:5: channels.http.secret_file: secret file '{token}' is readable by " \
                "every user" in d.reload_error and "chmod o-rwx" in d.reload_error
            assert d.last_reload is not None and d.last_reload["ok"] is False
            token.chmod(0o600)  # fixed: the same file now applies
            assert await d.reload() is True
            assert d.cfg.assistant.name == "Bob" and d.reload_error is None
        finally:
            d.stop_event.set()
            assert await task == 0

    asyncio.run(go())
