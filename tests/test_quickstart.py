"""The README's quick start, run from a fresh copy of the repository: with
config.example.yaml and no model configured, `mdclaw send --group main --wait 60 "hello"`
gets the configuration answer within 5 s, and `mdclaw doctor` says what to fix."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from waiting import wait_until

REPO = Path(__file__).resolve().parents[1]


def fresh_copy(dest: Path) -> Path:
    """The files a clone would have (tracked ones, as they are in the work tree)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_readme_quick_start_without_a_model(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("##", 1)[0]
    send_line = next(ln for ln in quick.splitlines() if " send " in ln)
    wait = float(re.search(r"--wait (\d+)", send_line).group(1))
    clone = fresh_copy(tmp_path / "clone")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(PYTHONPATH=str(clone), MDCLAW_CONFIG=str(clone / "config.example.yaml"),
               MDCLAW_DATA_DIR=str(tmp_path / "data"),
               MDCLAW_SERVER__LISTEN=f"127.0.0.1:{port}",
               # Wherever an engine is or is not, the answer must not depend on it.
               MDCLAW_RUNTIME__SOCKET=f"unix://{tmp_path}/no-engine.sock")
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen([sys.executable, "-m", "mdclaw", "run"], cwd=clone, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_until(listening, 30, interval=0.1, what=f"the daemon to listen on {port}")
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "mdclaw", "send", "--group", "main",
                            "--wait", f"{wait:g}", "--json", "hello"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=wait + 30)
        took = time.monotonic() - t0
        assert r.returncode == 0, (r.stdout, r.stderr, (tmp_path / "daemon.log").read_text())
        (reply,) = json.loads(r.stdout)["replies"]
        text = reply["content"]
        assert "No model is configured" in text and "`models:`" in text, text
        assert "docs/configuration.md" in text and "status 1" not in text
        # Answered at once, by the daemon's own clock (message in -> answer stored), which
        # the start of the `mdclaw send` process on a loaded machine does not count against;
        # and the command itself returned long before its --wait ran out.
        with sqlite3.connect(tmp_path / "data" / "state.db") as db:
            stored = dict(db.execute("SELECT direction, MIN(created_at) FROM http_messages"
                                     " GROUP BY direction").fetchall())
        answered = (datetime.fromisoformat(stored["out"].replace("Z", "+00:00"))
                    - datetime.fromisoformat(stored["in"].replace("Z", "+00:00")))
        assert answered.total_seconds() <= 5.0, (stored, took)
        assert took < wait / 2, took
        print(f"\nquick start: configuration answer after {answered.total_seconds():.2f} s "
              f"in the daemon, {took:.2f} s for `mdclaw send`")
        doctor = subprocess.run([sys.executable, "-m", "mdclaw", "doctor", "--json"], cwd=clone,
                                env=env, capture_output=True, text=True, timeout=60)
        checks = {c["check"]: c for c in json.loads(doctor.stdout)}
        assert doctor.returncode == 1
        assert checks["models"]["level"] == "fail" and "models:" in checks["models"]["fix"]
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(40)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    # The log says a message came in and what happened, at INFO, without the message text.
    lines = (tmp_path / "daemon.log").read_text().splitlines()
    assert any(ln.startswith("INFO mdclaw.orchestrator: group main: message ") and
               ln.endswith("in (5 characters)") for ln in lines), lines
    assert any("no_model" in ln for ln in lines)
    assert not any("hello" in ln for ln in lines)


def test_log_level_from_the_config_is_applied(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\nlog_level: warning\n"
                   "groups: {main: {name: A, jid: 'hl:main', main: true}}\n"
                   f"channels: {{http: {{listen: '127.0.0.1:{port}'}}}}\n"
                   f"runtime: {{socket: 'unix://{tmp_path}/no-engine.sock'}}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    daemon = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        sent: list[subprocess.CompletedProcess[str]] = []

        def send() -> bool:  # the daemon may not listen yet
            sent.append(subprocess.run([sys.executable, "-m", "mdclaw", "send", "--group",
                                        "main", "--wait", "20", "--config", str(cfg), "hi"],
                                       env=env, capture_output=True, text=True, timeout=60))
            return sent[-1].returncode == 0

        try:
            wait_until(send, 60, interval=0.2, what="`mdclaw send` to reach the daemon")
        finally:
            r = sent[-1]
            print(r.stdout, r.stderr)
        assert "No model is configured" in r.stdout, (r.stdout, r.stderr)
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=40)
    lines = out.splitlines()
    assert lines and not any(ln.startswith("INFO") for ln in lines), lines
    assert any(ln.startswith("WARNING mdclaw.orchestrator") and "no_model" in ln
               for ln in lines), lines
