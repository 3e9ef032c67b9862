"""Restart mid-run, in real processes: a scheduler claims tasks, is SIGKILLed while they run,
and the restarted scheduler neither fires them again for that slot nor loses the record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

from mdclaw import schedule
from mdclaw.state import Database
from mdclaw.state.tasks import get_task, insert_task, list_runs, update_task_fields
from waiting import wait_until

REPO = Path(__file__).resolve().parent.parent

# The child runs the real Scheduler on the real database file. mode "hang": every run writes a
# line to the marker file and then never finishes. mode "record": runs append to the marker
# file and return at once; the child stops itself after `seconds`.
CHILD = textwrap.dedent("""\
    import asyncio, sys
    from mdclaw.scheduler import Scheduler
    from mdclaw.state import Database

    db_path, mode, marker, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

    async def execute(task):
        with open(marker, "a") as f:
            f.write(task.id + "\\n")
        if mode == "hang":
            await asyncio.sleep(3600)
        return "ok"

    async def main():
        s = Scheduler(Database(db_path), execute)
        loop_task = asyncio.create_task(s.run())
        await asyncio.sleep(seconds)
        await s.stop(timeout=5)
        await loop_task

    asyncio.run(main())
""")


def start_child(tmp_path: Path, db_path: Path, mode: str, marker: Path,
                seconds: float) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, str(script), str(db_path), mode, str(marker),
                             str(seconds)], env=env, stderr=subprocess.PIPE, text=True)


def lines(p: Path) -> list[str]:
    return p.read_text().split() if p.exists() else []


def test_sigkill_mid_run_then_restart_does_not_refire(tmp_path: Path) -> None:
    db_path = tmp_path / "state.db"
    db = Database(db_path)
    now = schedule.utc_now()
    with db.transaction() as c:
        for tid, stype, value in (("cron-daily", "cron", "0 8 * * *"),
                                  ("every-hour", "interval", "3600000"),
                                  ("one-shot", "once",
                                   schedule.to_iso(now + timedelta(seconds=30)))):
            insert_task(c, group_folder="main", chat_jid="tg:1", prompt=tid,
                        schedule_type=stype, schedule_value=value, timezone="Europe/Berlin",
                        task_id=tid)
            update_task_fields(c, tid, next_run=schedule.to_iso(now))  # due now
    db.close()

    marker = tmp_path / "started.txt"
    child = start_child(tmp_path, db_path, "hang", marker, 600)
    wait_until(lambda: len(lines(marker)) >= 3, 20, interval=0.05,
               what="the three tasks to start")
    assert sorted(lines(marker)) == ["cron-daily", "every-hour", "one-shot"], child.stderr
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL

    db = Database(db_path)
    try:
        for tid in ("cron-daily", "every-hour", "one-shot"):
            assert [r.status for r in list_runs(db, tid)] == ["running"]
        next_runs = {t: get_task(db, t).next_run for t in ("cron-daily", "every-hour")}
    finally:
        db.close()

    after = tmp_path / "after-restart.txt"
    child2 = start_child(tmp_path, db_path, "record", after, 2.5)
    _, err = child2.communicate(timeout=30)
    assert child2.returncode == 0, err
    assert lines(after) == []  # nothing fired again
    assert "interrupted" in err  # the start-up recovery said what it did

    db = Database(db_path)
    try:
        for tid in ("cron-daily", "every-hour", "one-shot"):
            (log,) = list_runs(db, tid)
            assert log.status == "interrupted" and log.finished_at and "mdclaw stopped" in log.error
            assert get_task(db, tid).last_result.startswith("interrupted")
        one = get_task(db, "one-shot")
        assert one.status == "completed" and one.next_run is None
        for tid, nxt in next_runs.items():
            t = get_task(db, tid)
            assert t.status == "active" and t.next_run == nxt
            assert schedule.from_iso(t.next_run) > schedule.utc_now()
    finally:
        db.close()
