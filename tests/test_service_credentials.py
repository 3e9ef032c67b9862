"""The administrator's CLI on a host where secrets are systemd credentials (NixOS's module).

The service sees its secrets in $CREDENTIALS_DIRECTORY; the administrator's shell has no such
variable. Read-only commands must still work there (saying a secret is "set in the service's
credentials"), and commands that need a secret must say so instead of "does not exist". With
the variable set (as the NixOS wrapper's `systemd-run` gives `sudo mdclaw`), secrets are read
and checked as the service does. A member of the service's group reads a data_dir it cannot
write: the read-only commands work all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFIG = """\
data_dir: {data_dir}
assistant:
  name: Andy
  timezone: Europe/Berlin
  model: local
models:
  local:
    backend: openai
    model: fake
    base_url: "http://127.0.0.1:9/v1"
    api_key_file: "$CREDENTIALS_DIRECTORY/model-key"
groups:
  main:
    name: Admin
    jid: "hl:main"
    main: true
channels:
  http:
    listen: "127.0.0.1:9"
  telegram:
    token_file: "${{CREDENTIALS_DIRECTORY}}/telegram"
    api_base: "http://127.0.0.1:9"
tasks:
  - id: morning
    group: main
    prompt: Good morning
    cron: "0 8 * * *"
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data_dir=tmp_path / "data"))
    return p


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    return {}


def credentials_dir(tmp_path: Path, **secrets: str) -> Path:
    """A folder like systemd's: one 0400 file per credential, the folder 0500."""
    d = tmp_path / "credentials"
    d.mkdir()
    for name, value in secrets.items():
        (d / name).write_text(value + "\n")
        (d / name).chmod(0o400)
    d.chmod(0o500)
    return d


def test_check_config_accepts_service_credentials(cli, config: Path, no_credentials) -> None:
    r = cli("check-config", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert "does not exist" not in r.stderr
    assert "secret files: models.local.api_key_file, channels.telegram.token_file" in r.stdout


def test_read_only_commands_work_without_the_credentials(cli, config: Path,
                                                         no_credentials) -> None:
    assert cli("reconcile", "--config", str(config)).returncode == 0
    for args in (["status"], ["groups", "list"], ["tasks", "list"], ["outbox", "list"],
                 ["usage"], ["failures"], ["tasks", "logs", "morning"]):
        r = cli(*args, "--config", str(config))
        assert r.returncode == 0, (args, r.stderr)
        assert "does not exist" not in r.stderr, args


def test_doctor_says_set_in_the_service_credentials(cli, config: Path, no_credentials) -> None:
    cli("reconcile", "--config", str(config))
    r = cli("doctor", "--json", "--config", str(config))
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    for key in ("models.local.api_key_file", "channels.telegram.token_file"):
        assert checks[key]["level"] == "warn", checks[key]
        assert "set in the service's credentials" in checks[key]["detail"]
        assert "sudo mdclaw doctor" in checks[key]["fix"]
    model = checks["model local"]
    assert model["level"] == "warn" and "set in the service's credentials" in model["detail"]


def test_run_refuses_outside_the_service(cli, config: Path, no_credentials) -> None:
    r = cli("run", "--config", str(config), timeout=30)
    assert r.returncode == 1
    assert "models.local.api_key_file ($CREDENTIALS_DIRECTORY/model-key)" in r.stderr
    assert "set in the service's credentials" in r.stderr and "systemctl start" in r.stderr


def test_with_the_credentials_secrets_are_read_and_checked(cli, config: Path,
                                                           tmp_path: Path) -> None:
    creds = credentials_dir(tmp_path, **{"model-key": "sk-real", "telegram": "123:abc"})
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    cli("reconcile", "--config", str(config), env=env)
    r = cli("doctor", "--json", "--config", str(config), env=env)
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["models.local.api_key_file"]["level"] == "ok"
    assert checks["models.local.api_key_file"]["detail"] == \
        f"{creds}/model-key is readable"
    assert checks["channels.telegram.token_file"]["level"] == "ok"
    # the model server was asked (nothing answers on port 9): the key was usable
    assert "does not answer" in checks["model local"]["detail"]
    assert "sk-real" not in r.stdout + r.stderr


def test_with_the_credentials_a_missing_one_is_an_error(cli, config: Path,
                                                        tmp_path: Path) -> None:
    creds = credentials_dir(tmp_path, **{"model-key": "sk-real"})
    r = cli("check-config", "--config", str(config), env={"CREDENTIALS_DIRECTORY": str(creds)})
    assert r.returncode == 1
    assert f"secret file '{creds}/telegram' does not exist" in r.stderr


def _as_group_member(args: list[str]) -> list[str]:
    """As root: run as an unprivileged user (nobody) whose only group owns data_dir; else as
    ourselves, which cannot write the 0440 files and 0550 folders either."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is needed to drop root")
    return [setpriv, "--reuid=65534", f"--regid={READER_GID}", f"--groups={READER_GID}",
            "--inh-caps=-all", "--"]


READER_GID = 64999  # a group only the data_dir and the reader share


def _reaches_the_package(prefix: list[str]) -> bool:
    """Whether the unprivileged user can import mdclaw from this checkout."""
    r = subprocess.run([*prefix, sys.executable, "-c", "import mdclaw.cli"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    return r.returncode == 0


def test_a_group_member_reads_what_it_cannot_write(cli, no_credentials) -> None:
    """The service's data_dir as a member of its group sees it (0750 folders, 0640 files
    under UMask=0027, owned by the service's user): nothing writable. The read-only
    commands still answer."""
    base = Path(tempfile.mkdtemp(prefix="mdclaw-group-read-"))
    try:
        base.chmod(0o755)
        config = base / "config.yaml"
        config.write_text(CONFIG.format(data_dir=base / "data"))
        config.chmod(0o644)
        assert cli("reconcile", "--config", str(config)).returncode == 0
        data = base / "data"
        prefix = _as_group_member([])
        as_member = bool(prefix) and _reaches_the_package(prefix)
        if prefix and not as_member:
            # The checkout lies where nobody may look (a 0700 home or temporary folder): stay
            # root without any capability instead, so the owner's missing write bits hold.
            prefix = [prefix[0], "--bounding-set=-all", "--inh-caps=-all", "--"]
        for p in [data, *data.rglob("*")]:
            if as_member:
                os.chown(p, 0, READER_GID)
            p.chmod(0o750 if p.is_dir() else 0o640) if as_member else \
                p.chmod(0o550 if p.is_dir() else 0o440)
        before = {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in data.rglob("*")}
        for args in (["status", "--json"], ["groups", "list"], ["tasks", "list"],
                     ["outbox", "list"], ["usage"], ["doctor"]):
            r = subprocess.run([*prefix, sys.executable, "-m", "mdclaw", *args, "--config",
                                str(config)], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
            if args == ["doctor"]:  # the engine is not there: doctor may fail, never crash
                assert "Traceback" not in r.stderr, r.stderr
                continue
            assert r.returncode == 0, (args, r.stderr)
            assert "Traceback" not in r.stderr
        after = {p: (p.stat().st_mtime_ns, p.stat().st_mode) for p in data.rglob("*")}
        assert after == before  # nothing created, changed or removed

        # with the daemon's connection open (WAL and its index exist, as the daemon's user
        # made them under UMask=0027) the reader sees what it committed
        writer = sqlite3.connect(data / "state.db")
        try:
            writer.execute("PRAGMA journal_mode=WAL")
            writer.execute("UPDATE registered_groups SET name = 'Renamed' WHERE folder = 'main'")
            writer.commit()
            for p in data.glob("state.db-*"):
                if as_member:
                    os.chown(p, 0, READER_GID)
                p.chmod(0o640 if as_member else 0o440)
            r = subprocess.run([*prefix, sys.executable, "-m", "mdclaw", "groups", "list",
                                "--json", "--config", str(config)], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout)[0]["name"] == "Renamed"
        finally:
            writer.close()
    finally:
        for p in [base, *base.rglob("*")]:
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(base)


def test_variables_other_than_the_credentials_still_expand(cli, tmp_path: Path,
                                                           no_credentials) -> None:
    key = tmp_path / "key"
    key.write_text("k")
    key.chmod(0o600)
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data_dir=tmp_path / "data")
                 .replace("$CREDENTIALS_DIRECTORY/model-key", "$KEYDIR/key")
                 .replace("  telegram:\n    token_file: \"${CREDENTIALS_DIRECTORY}/telegram\"\n"
                          "    api_base: \"http://127.0.0.1:9\"\n", ""))
    assert cli("check-config", "--config", str(p), env={"KEYDIR": str(tmp_path)}).returncode == 0
    r = cli("check-config", "--config", str(p), env={"KEYDIR": "/nowhere"})
    assert r.returncode == 1 and "'/nowhere/key' does not exist" in r.stderr
    assert os.environ.get("CREDENTIALS_DIRECTORY") is None
