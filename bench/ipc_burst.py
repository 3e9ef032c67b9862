"""Throughput: a burst of valid commands spread over many groups.

The commands (60% messages, 30% new tasks, 10% pause/resume of existing tasks) are staged as
dot-files first, then renamed into place as fast as possible while the real IPC loop runs in
a child process; the figure is commands / (last removal - first rename). A second figure
drains the same kind of backlog written while the loop was stopped (a restart).

    python bench/ipc_burst.py [--commands 10000] [--groups 100]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from ipc_common import cpu_seconds, emit, make_data_dir, serve, stage


def _commands(ipc: Path, groups: list[str], n: int, tag: str) -> list[tuple[Path, Path]]:
    out = []
    for i in range(n):
        g = groups[i % len(groups)]
        r = i % 10
        name = f"{time.time_ns():019d}-{tag}{i}.json"
        if r < 6:
            sub, body = "messages", {"type": "message", "text": f"{tag} message {i}"}
        elif r < 9:
            sub, body = "tasks", {"type": "schedule_task", "taskId": f"{tag}-{i}", "prompt": "p",
                                  "schedule_type": "interval", "schedule_value": "3600000"}
        else:
            sub, body = "tasks", {"type": "pause_task" if (i // 10) % 2 == 0 else
                                  "resume_task", "taskId": f"base-{g}"}
        final = ipc / g / sub / name
        out.append((stage(final, body), final))
    return out


def _remaining(ipc: Path, groups: list[str]) -> int:
    return sum(1 for g in groups for sub in ("messages", "tasks")
               for n in os.listdir(ipc / g / sub) if not n.startswith("."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commands", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    fs = args.root or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        ipc = root / "data" / "ipc"
        groups = [f"g{i:03d}" for i in range(args.groups)]
        for g in groups:
            stage(ipc / g / "tasks" / "0-base.json",
                  {"type": "schedule_task", "taskId": f"base-{g}", "prompt": "p",
                   "schedule_type": "cron", "schedule_value": "0 8 * * *"}).rename(
                ipc / g / "tasks" / "0-base.json")
        server = serve(cfg)
        try:
            staged = _commands(ipc, groups, args.commands, "live")
            cpu0 = cpu_seconds(server.pid)
            first = time.monotonic_ns()
            for tmp_file, final in staged:
                os.rename(tmp_file, final)
            t_written = time.monotonic_ns()
            while _remaining(ipc, groups):
                time.sleep(0.002)
            t_removed = time.monotonic_ns()
            cpu = cpu_seconds(server.pid) - cpu0
        finally:
            commits = server.stop()
        names = {final.name for _, final in staged}
        last_commit = max(t for n, t in commits.items() if n in names)
        assert len(names & set(commits)) == args.commands
        common = {"groups": args.groups, "commands": args.commands, "fs": fs}
        emit("ipc_burst_live_committed", args.commands / ((last_commit - first) / 1e9),
             "commands/s", seconds=round((last_commit - first) / 1e9, 3),
             rename_seconds=round((t_written - first) / 1e9, 3), **common)
        emit("ipc_burst_live_removed", args.commands / ((t_removed - first) / 1e9),
             "commands/s", **common)
        emit("ipc_burst_cpu_per_command", cpu / args.commands * 1e6, "us", **common)

        # Backlog: everything is there before the loop starts (a restart after downtime).
        backlog = _commands(ipc, groups, args.commands, "backlog")
        for tmp_file, final in backlog:
            os.rename(tmp_file, final)
        t0 = time.monotonic_ns()
        server = serve(cfg)  # returns once the backlog is drained and the loop is idle
        commits = server.stop()
        names = {final.name for _, final in backlog}
        last_commit = max(t for n, t in commits.items() if n in names)
        assert _remaining(ipc, groups) == 0
        emit("ipc_burst_backlog_committed", args.commands / ((last_commit - t0) / 1e9),
             "commands/s", seconds=round((last_commit - t0) / 1e9, 3),
             note="includes process start-up", **common)


if __name__ == "__main__":
    main()
