"""CPU used by the IPC loop while nothing happens: 100 groups, 60 s, inotify on (and, for
comparison, polling only). The poll (1 s) still runs in both; folders whose mtime did not
change are not listed again.

    python bench/ipc_idle.py [--seconds 60] [--groups 100] [--tasks 0] [--no-inotify]

`--tasks N` adds N active tasks (next runs 1-30 days away, so none is due) to the database
before the loop starts.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ipc_common import cpu_seconds, emit, make_data_dir, serve


def add_tasks(db_path: Path, n: int, groups: int) -> None:
    """Insert `n` active interval tasks, spread over the groups, none due for a day."""
    from datetime import timedelta

    from mdclaw import schedule
    from mdclaw.state import Database

    now = schedule.utc_now()
    stamp = schedule.to_iso(now)
    rows = [(f"task-{i:07d}", f"g{i % groups:03d}", f"tg:{i % groups}", "prompt", "interval",
             "86400000", schedule.to_iso(now + timedelta(seconds=86400 + i * 20)), "active",
             stamp, "ipc", "UTC", 1, stamp) for i in range(n)]
    with Database(db_path) as db, db.transaction() as c:
        c.executemany(
            "INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,"
            " schedule_value, next_run, status, created_at, source, timezone, catch_up,"
            " updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--no-inotify", action="store_true")
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--tasks", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_data_dir(Path(tmp), args.groups)
        if args.tasks:
            add_tasks(Path(tmp) / "data" / "state.db", args.tasks, args.groups)
        server = serve(cfg, inotify=not args.no_inotify, poll=args.poll)
        try:
            time.sleep(2)  # let start-up settle (first poll lists every folder once)
            c0 = cpu_seconds(server.pid)
            time.sleep(args.seconds)
            cpu = cpu_seconds(server.pid) - c0
        finally:
            server.stop()
    emit("ipc_idle_cpu", cpu, "s", seconds=args.seconds, groups=args.groups,
         tasks=args.tasks, mode="polling only" if args.no_inotify else "inotify",
         poll_s=args.poll)


if __name__ == "__main__":
    main()
