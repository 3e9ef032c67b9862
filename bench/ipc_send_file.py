"""IPC commit latency for other groups while one group sends 64 MiB files.

100 groups; first an idle phase (pause/resume commands of random groups, one at a time, as
bench/ipc_latency.py does), then the same while group g050 keeps a 64 MiB `send_file` in
flight the whole time (a new one as soon as the previous copy reached the spool). Figures:
rename -> COMMIT p50/p99 for the other groups in both phases, their ratio, and how many
64 MiB copies were made meanwhile. The copy runs on the spooler's own thread, outside the IPC
transaction, so the ratio should stay near 1 (the target is at most 2).

    python bench/ipc_send_file.py [--samples 1000] [--groups 100] [--root DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from ipc_common import Removals, emit, make_data_dir, one_task_per_group, serve, stage

FILE_BYTES = 64 * 1024 * 1024


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(0, int(len(values) * q) - 1)]


def _phase(ipc: Path, groups: list[str], removals: Removals, samples: int, start: int,
           rng: random.Random, paused: dict[str, bool], renamed: dict[str, int]) -> list[str]:
    names = []
    for i in range(samples):
        g = rng.choice(groups)
        kind = "resume_task" if paused[g] else "pause_task"
        paused[g] = not paused[g]
        name = f"{start + i:013d}-lat.json"
        tmp_file = stage(ipc / g / "tasks" / name, {"type": kind, "taskId": f"t-{g}"})
        renamed[name] = time.monotonic_ns()
        tmp_file.rename(ipc / g / "tasks" / name)
        removals.wait_for(name, timeout=15)
        names.append(name)
        time.sleep(0.005)
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        data = root / "data"
        ipc = data / "ipc"
        sender = "g050"
        others = [f"g{i:03d}" for i in range(args.groups) if f"g{i:03d}" != sender]
        one_task_per_group(ipc, others)
        big = data / "groups" / sender / "big.bin"
        big.parent.mkdir(parents=True, exist_ok=True)
        with open(big, "wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(FILE_BYTES >> 20):
                f.write(chunk)
        spool = data / "spool" / "outbox"
        server = serve(cfg)
        renamed: dict[str, int] = {}
        stop = threading.Event()
        copies = [0]

        def keep_one_in_flight() -> None:
            n = 0
            while not stop.is_set():
                n += 1
                name = f"{n:013d}-file.json"
                stage(ipc / sender / "messages" / name,
                      {"type": "send_file", "chatJid": "tg:50",
                       "filePath": "/workspace/group/big.bin"}).rename(
                    ipc / sender / "messages" / name)
                deadline = time.monotonic() + 60
                while not stop.is_set() and time.monotonic() < deadline:
                    done = [p for p in spool.glob("*-big.bin")] if spool.exists() else []
                    if done:
                        for p in done:
                            p.unlink()
                        copies[0] += 1
                        break
                    time.sleep(0.002)

        try:
            removals = Removals([ipc / g / "tasks" for g in others])
            paused = dict.fromkeys(others, False)
            idle = _phase(ipc, others, removals, args.samples, 1, rng, paused, renamed)
            th = threading.Thread(target=keep_one_in_flight, daemon=True)
            th.start()
            busy = _phase(ipc, others, removals, args.samples, 10_000_000, rng, paused,
                          renamed)
            stop.set()
            th.join(60)
        finally:
            commits = server.stop()
    common = {"groups": args.groups, "samples": args.samples, "file_mib": FILE_BYTES >> 20}
    results = {}
    for phase, names in (("idle", idle), ("send_file_in_flight", busy)):
        ms = [(commits[n] - renamed[n]) / 1e6 for n in names]
        results[phase] = ms
        emit(f"ipc_commit_{phase}_p50", statistics.median(ms), "ms", **common)
        emit(f"ipc_commit_{phase}_p99", _pct(ms, 0.99), "ms", **common)
    emit("ipc_commit_p99_ratio_in_flight_over_idle",
         _pct(results["send_file_in_flight"], 0.99) / _pct(results["idle"], 0.99), "x",
         **common)
    emit("send_file_64mib_copies_during_phase", copies[0], "copies", **common)


if __name__ == "__main__":
    main()
