"""The README's Quick start as a new user runs it: `make run` (the daemon with
config.example.yaml, MDCLAW_DATA_DIR when DATA_DIR is given) and, from another shell, the
CLI lines with the Quick start's exports find that daemon; Ctrl+C (SIGINT) stops it and its
last log line says it stopped."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from operator_helpers import REPO, free_port
from waiting import wait_until


def quick_start() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return section.split("```sh", 1)[1].split("```", 1)[0]


def test_the_quick_start_says_what_make_run_does() -> None:
    run = re.search(r"^run:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert run is not None
    assert "MDCLAW_DATA_DIR=$(DATA_DIR)" in run[1] and "config.example.yaml" in run[1]
    block = quick_start()
    assert "make run" in block and "DATA_DIR" in block
    assert "export MDCLAW_CONFIG=$PWD/config.example.yaml" in block
    assert "export MDCLAW_DATA_DIR=" in block  # the CLI is pointed at make run's data
    assert "Ctrl+C" in block and '"stopped"' in block  # how to stop it
    assert "http://127.0.0.1:3000/operator/" in block  # the operator page, named


def test_make_run_with_data_dir_and_the_quick_starts_cli_agree(tmp_path: Path) -> None:
    """The daemon as `make run DATA_DIR=...` starts it (on a free port: others may hold
    3000); `mdclaw status` with the Quick start's two exports finds it running; SIGINT
    (Ctrl+C) stops it and "stopped" is its last log line."""
    data = tmp_path / "elsewhere"
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    base["PYTHONPATH"] = str(REPO)
    base["DOCKER_HOST"] = "unix:///nonexistent/mdclaw-test-no-engine.sock"
    daemon_env = {**base, "MDCLAW_DATA_DIR": str(data),
                  "MDCLAW_SERVER__LISTEN": f"127.0.0.1:{port}"}
    log = tmp_path / "daemon.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mdclaw", "run", "--config", "config.example.yaml"],
            cwd=REPO, env=daemon_env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the daemon exited:\n{log.read_text()}")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return bool(json.load(r).get("connected"))

        wait_until(up, 60, interval=0.1, ignore=(OSError, urllib.error.URLError),
                   what="the daemon to answer")
        # the Quick start's exports, as another shell has them
        exports = dict(re.findall(r"^export (\w+)=(\S+)", quick_start(), re.M))
        cli_env = {**base, **{k: v.replace("$PWD", str(REPO)) for k, v in exports.items()}}
        cli_env["MDCLAW_DATA_DIR"] = str(data)  # "the DATA_DIR you gave make run"
        r = subprocess.run([sys.executable, "-m", "mdclaw", "status", "--json"], cwd=REPO,
                           env=cli_env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert status["daemon"] == "running" and status["pid"] == proc.pid, status
        # without MDCLAW_DATA_DIR the CLI looks at ./data: not this daemon
        lost = {k: v for k, v in cli_env.items() if k != "MDCLAW_DATA_DIR"}
        r = subprocess.run([sys.executable, "-m", "mdclaw", "status", "--json"], cwd=REPO,
                           env=lost, capture_output=True, text=True, timeout=120)
        assert json.loads(r.stdout).get("pid") != proc.pid
        proc.send_signal(signal.SIGINT)  # Ctrl+C in make run's terminal
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    assert "stopped (exit 0)" in lines[-1], lines[-5:]
    assert any("stopping: draining" in ln for ln in lines)
