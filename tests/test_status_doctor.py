"""`mdclaw status` with and without a running daemon; `mdclaw doctor` lines and exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO


def test_status_without_daemon(cli, write_config) -> None:
    cfg = str(write_config())
    r = cli("status", "--json", "--config", cfg)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["daemon"] == "stopped" and s["groups"] == 0
    cli("reconcile", "--config", cfg)
    s = json.loads(cli("status", "--json", "--config", cfg).stdout)
    assert s["groups"] == 2 and s["outbox"]["pending"] == 0
    assert "daemon: not running" in cli("status", "--config", cfg).stdout


def test_status_with_running_daemon(write_config, cli, data_dir, tmp_path) -> None:
    cfg = str(write_config(f"""\
        data_dir: {{data_dir}}
        groups:
          main: {{name: A, jid: "hl:main", main: true}}
        channels: {{http: {{listen: "127.0.0.1:0"}}}}
        runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", cfg], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        s = {}
        while time.monotonic() < deadline:
            s = json.loads(cli("status", "--json", "--config", cfg).stdout)
            if s["daemon"] == "running":
                break
            time.sleep(0.2)
        assert s["daemon"] == "running", s
        assert s["pid"] == proc.pid
        assert "unreachable" in s["engine"] or "no container engine" in s["engine"], s["engine"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert json.loads(cli("status", "--json", "--config", cfg).stdout)["daemon"] == "stopped"


def test_doctor_reports_each_problem_with_a_fix(cli, write_config, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("")
    token.chmod(0o600)
    cfg = str(write_config(f"""\
        data_dir: {{data_dir}}
        groups:
          main: {{name: A, jid: "hl:main", main: true}}
        channels: {{telegram: {{token_file: {token}}}}}
        runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
    """))
    r = cli("doctor", "--json", "--config", cfg)
    assert r.returncode == 1
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["config"]["level"] == "ok"
    assert checks["data_dir"]["level"] == "ok"
    assert checks["engine"]["level"] == "fail" and checks["engine"]["fix"]
    assert checks["channels.telegram.token_file"]["level"] == "fail"
    assert "empty" in checks["channels.telegram.token_file"]["detail"]
    assert checks["clock"]["level"] == "ok"
    human = cli("doctor", "--config", cfg).stdout
    assert "FAIL  engine" in human and "fix:" in human
    bad = write_config("groups: [\n", name="bad.yaml")
    r = cli("doctor", "--config", str(bad))
    assert r.returncode == 1 and "FAIL  config" in r.stdout


def test_sighup_applies_a_valid_config_and_says_what_needs_a_restart(write_config, cli,
                                                                      tmp_path) -> None:
    base = """\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true}
        runtime: {socket: "unix://%s/no-engine.sock"}
        channels: {http: {listen: "127.0.0.1:0"}}
    """ % tmp_path
    cfg = write_config(base)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if json.loads(cli("status", "--json", "--config", str(cfg)).stdout)["daemon"] \
                    == "running":
                break
            time.sleep(0.2)
        write_config(base.replace("""          main: {name: A, jid: "hl:main", main: true}""",
                                  """          main: {name: A, jid: "hl:main", main: true}
          extra: {name: E, jid: "hl:extra"}""").replace('"127.0.0.1:0"', '"127.0.0.1:1"'))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        folders: set[str] = set()
        while time.monotonic() < deadline and "extra" not in folders:
            rows = json.loads(cli("groups", "list", "--json", "--config", str(cfg)).stdout)
            folders = {r["folder"] for r in rows}
            time.sleep(0.2)
        assert folders == {"main", "extra"}
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "reload: channels changed; restart mdclaw to apply it" in err
    assert "reloaded: " in err
