"""Bursts end to end: command files -> committed -> the channel's send call, and fairness.

The real IPC loop (`IpcWatcher`) and the real `OutboxWorker` run on one event loop in a child
process, wired as in the daemon (each commit wakes the outbox); the channel records when its
`send_message` is entered. Every command is a `message` whose text is its file name.

    python bench/ipc_flood.py spread [--groups 100] [--commands 10000] [--root /dev/shm]
    python bench/ipc_flood.py single [--commands 10000]       # one folder gets everything
    python bench/ipc_flood.py fair [--commands 10000] [--probes 200]

`spread` and `single` print commands/s committed (last commit - first rename) and delivered
(last send call - first rename), and the time from the first commit to the first send call.
`fair`: group g001 floods `--commands` while group g002 sends one command every 5 ms; figures
are g002's rename -> commit (p50/p99) during the flood and the first delivery after its commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ipc_common import RECORDING, REPO, cpu_seconds, emit, make_data_dir, stage, stop

SERVE = """
import asyncio, json, signal, sys, time
sys.path.insert(0, {repo!r})
from mdclaw.channels.base import Channel
from mdclaw.config import load_config
from mdclaw.state import Database
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.outbox import OutboxWorker
cfg = load_config({cfg!r})
commits, sends = {{}}, {{}}

{recording}
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    db = Database(cfg.db_path)
    outbox = OutboxWorker(db, [Recording()])
    w = IpcWatcher(cfg, db)
    def on_commit(items):
        now = time.monotonic_ns()
        for it in items:
            commits[it.name] = now
        outbox.wake()
    w.engine.on_commit = on_commit
    await outbox.start()
    t = asyncio.create_task(w.run(stop))
    while not w.idle.is_set():
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    await t
    await outbox.stop()
    w.close()
    with open({out!r}, "w") as f:
        json.dump({{"commits": commits, "sends": sends}}, f)
asyncio.run(main())
"""


class Server:
    def __init__(self, cfg_path: Path) -> None:
        self.out = cfg_path.parent / f"flood-{time.monotonic_ns()}.json"
        code = SERVE.format(repo=str(REPO), cfg=str(cfg_path), out=str(self.out),
                            recording=RECORDING)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line
        self.pid = self.proc.pid

    def wait_sent(self, n: int, timeout: float = 600) -> None:
        # The child writes nothing until it stops; poll the outbox row count instead.
        import sqlite3
        db = self.out.parent / "data" / "state.db"
        deadline = time.monotonic() + timeout
        conn = sqlite3.connect(db, timeout=30)
        try:
            while time.monotonic() < deadline:
                row = conn.execute("SELECT count(*) FROM outbox WHERE status = 'sent'").fetchone()
                if row[0] >= n:
                    return
                time.sleep(0.05)
        finally:
            conn.close()
        raise TimeoutError(f"{n} sends")

    def stop(self) -> dict[str, dict[str, int]]:
        stop(self.proc)
        return json.loads(self.out.read_text())


def _stage(ipc: Path, group: str, tag: str, i: int) -> tuple[Path, Path]:
    name = f"{time.time_ns():019d}-{tag}{i:06d}.json"
    final = ipc / group / "messages" / name
    return stage(final, {"type": "message", "text": name}), final


def _pcts(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"n": len(s), "p50_ms": round(statistics.median(s), 3),
            "p99_ms": round(s[max(0, int(len(s) * 0.99) - 1)], 3), "max_ms": round(s[-1], 3)}


def run_burst(root: Path, groups: int, commands: int, single: bool, fs: str) -> None:
    cfg = make_data_dir(root, groups)
    ipc = root / "data" / "ipc"
    names = [f"g{i:03d}" for i in range(groups)]
    server = Server(cfg)
    try:
        staged = [_stage(ipc, names[1 % groups] if single else names[i % groups], "b", i)
                  for i in range(commands)]
        cpu0 = cpu_seconds(server.pid)
        first = time.monotonic_ns()
        for tmp_file, final in staged:
            os.rename(tmp_file, final)
        t_written = time.monotonic_ns()
        server.wait_sent(commands)
        cpu = cpu_seconds(server.pid) - cpu0
    finally:
        res = server.stop()
    want = {final.name for _, final in staged}
    commits = [t for n, t in res["commits"].items() if n in want]
    sends = [t for n, t in res["sends"].items() if n in want]
    assert len(commits) == commands and len(sends) == commands, (len(commits), len(sends))
    common = {"groups": 1 if single else groups, "commands": commands, "fs": fs}
    emit("flood_committed", commands / ((max(commits) - first) / 1e9), "commands/s",
         rename_seconds=round((t_written - first) / 1e9, 3), **common)
    emit("flood_delivered", commands / ((max(sends) - first) / 1e9), "commands/s", **common)
    emit("flood_first_send_after_first_commit", (min(sends) - min(commits)) / 1e6, "ms",
         **common)
    emit("flood_cpu_per_command", cpu / commands * 1e6, "us", **common)


def run_fair(root: Path, commands: int, probes: int, fs: str) -> None:
    cfg = make_data_dir(root, 100)
    ipc = root / "data" / "ipc"
    server = Server(cfg)
    flood = [_stage(ipc, "g001", "f", i) for i in range(commands)]
    probe = [_stage(ipc, "g002", "p", i) for i in range(probes)]
    renamed: dict[str, int] = {}
    flood_end = [0]

    def flooder() -> None:
        for tmp_file, final in flood:
            os.rename(tmp_file, final)
        flood_end[0] = time.monotonic_ns()

    try:
        th = threading.Thread(target=flooder)
        t0 = time.monotonic_ns()
        th.start()
        for tmp_file, final in probe:
            renamed[final.name] = time.monotonic_ns()
            os.rename(tmp_file, final)
            time.sleep(0.005)
        th.join()
        server.wait_sent(commands + probes)
    finally:
        res = server.stop()
    commits, sends = res["commits"], res["sends"]
    flood_names = {f.name for _, f in flood}
    flood_last = max(commits[n] for n in flood_names)
    during = [(commits[n] - t) / 1e6 for n, t in renamed.items() if t < flood_last]
    common = {"flood_commands": commands, "fs": fs}
    emit("fair_probe_commit_during_flood", _pcts(during)["p99_ms"], "ms p99", **_pcts(during),
         **common, flood_seconds=round((flood_last - t0) / 1e9, 3))
    all_names = list(flood_names) + list(renamed)
    first_commit = min(commits[n] for n in all_names)
    first_send = min(sends[n] for n in all_names)
    emit("fair_first_send_after_first_commit", (first_send - first_commit) / 1e6, "ms",
         **common)
    probe_sends = [(sends[n] - commits[n]) / 1e6 for n in renamed if renamed[n] < flood_last]
    emit("fair_probe_commit_to_send_during_flood", _pcts(probe_sends)["p99_ms"], "ms p99",
         **_pcts(probe_sends), **common)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("spread", "single", "fair"))
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--commands", type=int, default=10_000)
    ap.add_argument("--probes", type=int, default=200)
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    fs = args.root or tempfile.gettempdir()
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        if args.mode == "fair":
            run_fair(Path(tmp), args.commands, args.probes, fs)
        else:
            run_burst(Path(tmp), max(args.groups, 2), args.commands, args.mode == "single", fs)


if __name__ == "__main__":
    main()
