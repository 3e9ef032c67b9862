"""The real CLI in a subprocess: exit codes, plans, listings, the daemon's clean stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO
from mdclaw.config import load_config
from mdclaw.ops.status import status_path
from waiting import wait_until


def test_check_config_valid_invalid_usage(cli, write_config) -> None:
    ok = cli("check-config", "--config", str(write_config()))
    assert ok.returncode == 0, ok.stderr
    assert "config ok: 2 group(s), main: main" in ok.stdout
    bad = write_config("groups:\n  main: {name: A, jid: 'x', main: true, tigger: '@x'}\n"
                       "assistant: {timezone: Foo/Bar}\n", name="bad.yaml")
    r = cli("check-config", "--config", str(bad))
    assert r.returncode == 1
    assert "did you mean 'trigger'" in r.stderr and "Foo/Bar" in r.stderr
    assert f"{bad}:2:" in r.stderr  # the timezone line
    assert cli("check-config", "--bogus").returncode == 2
    assert cli().returncode == 2


def test_config_from_env_var(cli, write_config) -> None:
    p = write_config()
    r = cli("check-config", env={"MDCLAW_CONFIG": str(p)})
    assert r.returncode == 0, r.stderr


def test_reconcile_dry_run_then_apply_then_noop(cli, write_config, data_dir) -> None:
    cfg = str(write_config())
    r = cli("reconcile", "--dry-run", "--json", "--config", cfg)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["applied"] is False
    assert {a["target"] for a in plan["actions"] if a["kind"] == "add_group"} == {"main", "family"}
    assert not (data_dir / "groups").exists()
    r = cli("reconcile", "--config", cfg)
    assert r.returncode == 0 and "did: add group main" in r.stdout
    r = cli("reconcile", "--config", cfg)
    assert "nothing to do" in r.stdout
    r = cli("groups", "list", "--json", "--config", cfg)
    rows = json.loads(r.stdout)
    assert {tuple(sorted(row)) for row in rows} == {tuple(sorted(
        ["folder", "name", "jid", "trigger", "requires_trigger", "is_main", "source",
         "chats", "session", "may_send_to", "allow_senders", "refused", "last_refused_at"]))}
    main = next(x for x in rows if x["folder"] == "main")
    assert main == {"folder": "main", "name": "Admin chat", "jid": "tg:123456",
                    "trigger": "@Andy", "requires_trigger": False, "is_main": True,
                    "source": "config", "chats": ["tg:123456"], "session": "shared",
                    "may_send_to": [], "allow_senders": None, "refused": 0,
                    "last_refused_at": None}
    table = cli("groups", "list", "--config", cfg).stdout
    assert table.splitlines()[0].split() == ["FOLDER", "NAME", "JID", "TRIGGER",
                                             "REQUIRES_TRIGGER", "IS_MAIN", "SOURCE",
                                             "OTHER_CHATS", "SENDERS", "REFUSED"]


def test_invalid_config_changes_nothing(cli, write_config, data_dir) -> None:
    cfg = str(write_config())
    assert cli("reconcile", "--config", cfg).returncode == 0
    before = (data_dir / "state.db").read_bytes()
    bad = write_config("data_dir: {data_dir}\ngroups:\n  main: {name: A, jid: 'x', main: true}\n"
                       "  b: {name: B, jid: 'y', main: true}\n", name="bad.yaml")
    r = cli("reconcile", "--config", str(bad))
    assert r.returncode == 1 and "exactly one group" in r.stderr
    listing = json.loads(cli("groups", "list", "--json", "--config", cfg).stdout)
    assert {g["folder"] for g in listing} == {"main", "family"}
    assert len(before) > 0


def test_python_dash_m_and_console_script_agree(cli) -> None:
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("mdclaw ")


def test_run_reconciles_and_stops_on_sigterm(write_config, data_dir) -> None:
    cfg = str(write_config())
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", cfg],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (data_dir / "ipc" / "main" / "tasks").is_dir(), 20,
                   what="the daemon to make ipc/main/tasks")
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err


def test_logs_carry_journald_priority_under_systemd(write_config, tmp_path) -> None:
    cfg = str(write_config("data_dir: {data_dir}\ngroups: {}\nchannels: {http: {enabled: false}}\n"
                           f"runtime: {{socket: 'unix://{tmp_path}/none.sock'}}\n"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(PYTHONPATH=str(REPO), JOURNAL_STREAM="8:12345")
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", cfg], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Up (and so it has logged its start) once it has written its status file.
    status_file = status_path(load_config(cfg))
    wait_until(lambda: status_file.exists() or proc.poll() is not None, 60,
               what="the daemon's status file")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=40)
    lines = [ln for ln in err.splitlines() if ln and not ln.startswith("  ")]
    assert lines and all(ln[:3] in ("<6>", "<4>", "<3>", "<7>") for ln in lines), err
    assert any(ln.startswith("<4>") and "unreachable" in ln for ln in lines), err
