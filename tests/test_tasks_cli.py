"""`mdclaw tasks ...` in a subprocess against a real state database, and run-now against a
running daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from mdclaw import schedule
from mdclaw.config import load_config
from mdclaw.ops.status import status_path
from mdclaw.reconcile import reconcile
from mdclaw.scheduler import Scheduler
from mdclaw.state import Database
from mdclaw.state.tasks import get_task, insert_task, list_runs, update_task_fields
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent

CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: Europe/Berlin}
groups:
  main: {name: Admin, jid: "tg:1", main: true}
  family: {name: Family, jid: "tg:2"}
tasks:
  - id: weather
    group: family
    prompt: Send the weather
    cron: "0 8 * * *"
  - id: ny-report
    group: main
    prompt: Report
    cron: "0 9 * * *"
    timezone: America/New_York
"""


@pytest.fixture
def env(write_config):
    """(config path, db): the config reconciled, plus one runtime (IPC) task."""
    path = write_config(CONFIG)
    cfg = load_config(path)
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    with db.transaction() as c:
        insert_task(c, group_folder="family", chat_jid="tg:2", prompt="Water the plants",
                    schedule_type="interval", schedule_value="3600000", timezone="Europe/Berlin",
                    task_id="plants")
    yield str(path), db
    db.close()


def ok(r: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert r.returncode == 0, (r.stdout, r.stderr)
    return r


def test_list_json_has_utc_times_and_fields(env, cli) -> None:
    path, db = env
    rows = json.loads(ok(cli("tasks", "list", "--json", "--config", path)).stdout)
    assert sorted(r["id"] for r in rows) == ["ny-report", "plants", "weather"]
    for r in rows:
        for k in ("id", "group_folder", "chat_jid", "prompt", "schedule_type", "schedule_value",
                  "context_mode", "status", "next_run", "source"):
            assert k in r
        assert r["next_run"].endswith("Z")
        assert r["next_run"] == get_task(db, r["id"]).next_run
    by_id = {r["id"]: r for r in rows}
    assert by_id["weather"]["source"] == "config" and by_id["plants"]["source"] == "ipc"
    assert schedule.from_iso(by_id["weather"]["next_run"]) == schedule.next_cron(
        "0 8 * * *", "Europe/Berlin", schedule.utc_now())
    fam = json.loads(ok(cli("tasks", "list", "--group", "family", "--json",
                            "--config", path)).stdout)
    assert sorted(r["id"] for r in fam) == ["plants", "weather"]


def test_list_table_shows_next_run_in_task_timezone(env, cli) -> None:
    path, db = env
    out = ok(cli("tasks", "list", "--config", path)).stdout
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert " 08:00:00 CE" in lines["weather"]  # CET or CEST, 08:00 Berlin time
    assert " 09:00:00 E" in lines["ny-report"]  # EST or EDT, 09:00 New York time
    assert out.splitlines()[0].split()[:5] == ["ID", "GROUP", "SCHEDULE", "STATUS", "NEXT_RUN"]
    assert "no tasks in group 'nobody'" in ok(cli("tasks", "list", "-g", "nobody",
                                                  "--config", path)).stdout


def test_show(env, cli) -> None:
    path, db = env
    out = ok(cli("tasks", "show", "weather", "--config", path)).stdout
    assert "Europe/Berlin (assistant's)" not in out  # config tasks store their zone
    assert "schedule      cron 0 8 * * *" in out and "status        active" in out
    data = json.loads(ok(cli("tasks", "show", "plants", "--json", "--config", path)).stdout)
    assert data["id"] == "plants" and data["recent_runs"] == []
    r = cli("tasks", "show", "nope", "--config", path)
    assert r.returncode == 1 and "no task with id 'nope'" in r.stderr


def test_pause_resume_cancel(env, cli) -> None:
    path, db = env
    assert "task plants paused" in ok(cli("tasks", "pause", "plants", "--config", path)).stdout
    assert get_task(db, "plants").status == "paused"
    assert "already paused" in ok(cli("tasks", "pause", "plants", "--config", path)).stdout
    r = cli("tasks", "run-now", "plants", "--config", path)
    assert r.returncode == 1 and "paused; resume it first" in r.stderr
    anchor = schedule.from_iso(get_task(db, "plants").next_run) - timedelta(hours=5, minutes=7)
    with db.transaction() as c:  # paused long enough for its slot to pass
        update_task_fields(c, "plants", next_run=schedule.to_iso(anchor))
    out = ok(cli("tasks", "resume", "plants", "--json", "--config", path)).stdout
    t = json.loads(out)
    assert t["status"] == "active"
    nxt = schedule.from_iso(t["next_run"])
    assert nxt > schedule.utc_now()
    assert nxt - schedule.utc_now() <= timedelta(hours=1)
    assert (nxt - anchor) % timedelta(hours=1) == timedelta(0)  # the same grid, no backlog
    r = ok(cli("tasks", "cancel", "weather", "--config", path))
    assert "task weather cancelled" in r.stdout and "comes from the config" in r.stderr
    w = get_task(db, "weather")
    assert w.status == "completed" and w.next_run is None
    r = cli("tasks", "resume", "weather", "--config", path)
    assert r.returncode == 1 and "only a paused task can be resumed" in r.stderr
    r = cli("tasks", "run-now", "weather", "--config", path)
    assert r.returncode == 1 and "cancelled" in r.stderr
    r = cli("tasks", "pause", "ghost", "--config", path)
    assert r.returncode == 1 and "no task with id 'ghost'" in r.stderr


def test_run_now_and_logs(env, cli) -> None:
    path, db = env
    r = ok(cli("tasks", "run-now", "plants", "--config", path))
    assert "due now" in r.stdout
    t = get_task(db, "plants")
    assert schedule.from_iso(t.next_run) <= schedule.utc_now()
    assert "has not run yet" in ok(cli("tasks", "logs", "plants", "--config", path)).stdout

    async def execute(task):
        return "watered"

    import asyncio

    s = Scheduler(db, execute)

    async def once() -> None:
        s.tick()
        await s.drain(5)

    asyncio.run(once())
    logs = json.loads(ok(cli("tasks", "logs", "plants", "--json", "--config", path)).stdout)
    assert [(x["status"], x["result"], x["missed"]) for x in logs] == [("success", "watered", 0)]
    assert logs[0]["run_at"].endswith("Z")
    out = ok(cli("tasks", "logs", "plants", "--config", path)).stdout
    assert "success" in out and "watered" in out
    shown = ok(cli("tasks", "show", "plants", "--config", path)).stdout
    assert "recent runs:" in shown and "last_result   watered" in shown


def test_run_now_rearms_a_finished_one_shot(env, cli) -> None:
    path, db = env
    with db.transaction() as c:
        insert_task(c, group_folder="main", chat_jid="tg:1", prompt="remind",
                    schedule_type="once", timezone="UTC", task_id="remind",
                    schedule_value=schedule.to_iso(schedule.utc_now() + timedelta(hours=1)))
        update_task_fields(c, "remind", status="completed", next_run=None)
    t = json.loads(ok(cli("tasks", "run-now", "remind", "--json", "--config", path)).stdout)
    assert t["status"] == "active" and t["next_run"]


def test_daemon_picks_up_run_now(env, cli, data_dir) -> None:
    """The running daemon claims a task made due by `tasks run-now` from another process.
    (What the run then does is the executor's business: no engine is running here.)"""
    path, db = env
    Path(path).write_text(Path(path).read_text() + "channels:\n  http: {enabled: false}\n")
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    proc_env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", path],
                            env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        # The daemon is up (its scheduler runs) once it has written its status file.
        status_file = status_path(load_config(path))
        wait_until(lambda: status_file.exists() or proc.poll() is not None, 60,
                   what="the daemon's status file")
        assert proc.poll() is None and status_file.exists(), "the daemon did not start"
        assert list_runs(db, "plants") == []
        before = get_task(db, "plants").next_run
        ok(cli("tasks", "run-now", "plants", "--config", path))
        asked = time.monotonic()
        runs = wait_until(lambda: list_runs(db, "plants"), 10,
                          what="the daemon to claim the task")
        assert time.monotonic() - asked < 3  # one re-check interval (1 s), with slack for load
        assert len(runs) == 1 and runs[0].missed == 0
        t = get_task(db, "plants")
        assert t.next_run != before and schedule.from_iso(t.next_run) > schedule.utc_now()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    # However the run ended, it was recorded, and only once.
    (run,) = list_runs(db, "plants")
    assert run.status in ("success", "error", "interrupted") and run.finished_at
