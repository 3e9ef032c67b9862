"""Invariant 2 under fire: `mdclaw run` is killed with SIGKILL at random points while it
works through bursts of commands, restarted, 20 rounds. Afterwards every command was
applied exactly once or quarantined, and none was lost."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import REPO
from ipc_helpers import Env

ROUNDS = 20
BURST = 1000
GROUPS = ["main", "family", "work"] + [f"g{i:03d}" for i in range(7)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return env


def _remaining(ipc: Path) -> int:
    n = 0
    for g in GROUPS:
        for sub in ("messages", "tasks"):
            n += sum(1 for x in os.listdir(ipc / g / sub) if x.endswith(".json")
                     and not x.startswith("."))
    return n


@pytest.mark.slow
def test_sigkill_at_random_points_never_loses_or_doubles(tmp_path: Path) -> None:
    rng = random.Random(20260223)
    env = Env(tmp_path, extra_groups=7, max_files=10_000)
    env.db.close()
    ipc = env.ipc
    expected: dict[tuple[str, str, str], tuple[str, str]] = {}  # file -> (kind, key)
    kills_mid_burst = 0
    seq = 0

    def write(group: str, sub: str, body: dict) -> str:
        nonlocal seq
        seq += 1
        name = f"{seq:09d}.json"
        d = ipc / group / sub
        tmp = d / f".{name}.tmp"
        tmp.write_text(json.dumps(body))
        os.rename(tmp, d / name)
        return name

    for rnd in range(ROUNDS):
        proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config",
                                 str(env.config_path)], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for i in range(BURST):
                g = GROUPS[i % len(GROUPS)]
                r = i % 10
                if r < 6:
                    text = f"r{rnd}-m{i}"
                    body = {"type": "message", "text": text}
                    expected[(g, "messages", write(g, "messages", body))] = ("text", text)
                elif r < 9:
                    tid = f"r{rnd}-t{i}"
                    body = {"type": "schedule_task", "taskId": tid, "prompt": "p",
                            "schedule_type": "interval", "schedule_value": "3600000"}
                    expected[(g, "tasks", write(g, "tasks", body))] = ("task", tid)
                elif g == "main":
                    tid = f"r{rnd}-u{i}"
                    body = {"type": "update_task", "taskId": "nonexistent",
                            "updates": {"prompt": tid}}
                    expected[(g, "tasks", write(g, "tasks", body))] = ("reject", tid)
                else:  # unauthorized: a non-main group registering a group
                    body = {"type": "register_group", "jid": f"x{rnd}{i}", "name": "n",
                            "folder": f"f{rnd}x{i}"}
                    expected[(g, "tasks", write(g, "tasks", body))] = ("reject", "")
            # Kill at a random point once the daemon is working through the burst.
            total = _remaining(ipc)
            deadline = time.monotonic() + 30
            while _remaining(ipc) >= total and time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise AssertionError(f"daemon exited with {proc.returncode}")
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.1))
            if 0 < _remaining(ipc):
                kills_mid_burst += 1
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # Recovery: one clean drain of whatever is left.
    r = subprocess.run([sys.executable, "-m", "mdclaw", "ipc", "drain", "--json", "--config",
                        str(env.config_path)], env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["pending"] == 0
    assert _remaining(ipc) == 0
    assert kills_mid_burst >= ROUNDS // 2, kills_mid_burst

    import sqlite3
    conn = sqlite3.connect(env.cfg.db_path)
    texts = Counter(t for (t,) in conn.execute("SELECT text FROM outbox"))
    tasks = {t for (t,) in conn.execute("SELECT id FROM scheduled_tasks")}
    conn.close()
    quarantined = {}
    for p in (ipc / "errors").iterdir():
        if p.name.endswith(".error.json"):
            meta = json.loads(p.read_text())
            quarantined[(meta["source_group"], *meta["original_file"].split("/"))] = meta
    problems = []
    for key, (kind, value) in expected.items():
        q = key in quarantined
        if kind == "text":
            if texts[value] != 1 or q:
                problems.append((key, kind, texts[value], q))
        elif kind == "task":
            if value not in tasks or q:
                problems.append((key, kind, value in tasks, q and quarantined[key]["error"]))
        elif not q:
            problems.append((key, kind, "not quarantined"))
    assert not problems, problems[:10]
    assert sum(texts.values()) == sum(1 for k, _ in expected.values() if k == "text")
    assert len(quarantined) == sum(1 for k, _ in expected.values() if k == "reject")
