"""Latency from a command file's rename into tasks/ to its effect being committed.

100 groups registered, each with one task; each sample renames a pause_task/resume_task for
a random group's own task into that group's tasks/, then waits until the file is gone
before the next. Figures: rename -> COMMIT (timed inside the loop's process right after
COMMIT, on the system-wide monotonic clock) and rename -> file removed. Run with
--no-inotify for the polling control.

    python bench/ipc_latency.py [--samples 2000] [--groups 100] [--no-inotify] [--poll 1.0]
                                [--root DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from ipc_common import Removals, emit, make_data_dir, one_task_per_group, serve, stage


def _stats(name: str, values: list[float], **common: object) -> None:
    values = sorted(values)
    emit(f"{name}_p50", statistics.median(values), "ms", **common)
    emit(f"{name}_p99", values[max(0, int(len(values) * 0.99) - 1)], "ms", **common)
    emit(f"{name}_max", values[-1], "ms", **common)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--no-inotify", action="store_true")
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between commands")
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        ipc = root / "data" / "ipc"
        groups = [f"g{i:03d}" for i in range(args.groups)]
        one_task_per_group(ipc, groups)  # created before the loop starts
        server = serve(cfg, inotify=not args.no_inotify, poll=args.poll)
        renamed: dict[str, int] = {}
        removed: list[float] = []
        try:
            removals = Removals([ipc / g / "tasks" for g in groups])
            paused = dict.fromkeys(groups, False)
            for i in range(args.samples):
                g = rng.choice(groups)
                kind = "resume_task" if paused[g] else "pause_task"
                paused[g] = not paused[g]
                name = f"{i + 1:013d}-lat.json"
                tmp_file = stage(ipc / g / "tasks" / name, {"type": kind, "taskId": f"t-{g}"})
                t0 = time.perf_counter()
                renamed[name] = time.monotonic_ns()
                tmp_file.rename(ipc / g / "tasks" / name)
                t1 = removals.wait_for(name, timeout=10 + 2 * args.poll)
                removed.append((t1 - t0) * 1000)
                time.sleep(args.gap)
        finally:
            commits = server.stop()
    committed = [(commits[n] - t) / 1e6 for n, t in renamed.items()]
    common = {"groups": args.groups, "samples": len(committed),
              "mode": "polling only" if args.no_inotify else "inotify", "poll_s": args.poll,
              "fs": args.root or tempfile.gettempdir()}
    _stats("ipc_latency_commit", committed, **common)
    _stats("ipc_latency_removed", removed, **common)


if __name__ == "__main__":
    main()
