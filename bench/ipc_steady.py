"""Steady traffic: command files at a fixed rate, each written as it is due.

A household's traffic is a trickle, not a burst: here `--rate` `message` commands a second,
round the groups (100 by default), each file written to a dot-file and renamed into its
group's `messages/` at its due time, the way the agent runner writes. The figure is the
child's CPU (user + system, every thread) from the first file to the last delivered (mdclaw)
or committed (floor), per command; `cpu_settled_us` also counts the work mdclaw put off
until after it (the transcript's last index batch, the WAL checkpoint down to SQLite's own
threshold: see ipc_floor.py). The floor (bench/ipc_floor.py: inotify, read,
`json.loads`, INSERT, COMMIT, unlink) gets the same trickle; each round runs the floor, then
mdclaw (then `--before`'s tree), and the last line gives the medians and their ratios.

`--breakdown` also says where mdclaw's main thread (the IPC loop's) spends that CPU: the
thread-time probes of bench/cost_probe.py, on from the first file to the last delivery,
give each piece's microseconds a command by the path of pieces it ran under
("turn/round/apply/commit"), and `.../rest` what a piece spent outside the pieces under it.
The probes cost a few microseconds a call themselves: compare breakdowns with breakdowns.

    python bench/ipc_steady.py [--rate 20] [--seconds 15] [--groups 100] [--rounds 3]
                               [--channel bench|http] [--breakdown] [--log]
                               [--before /tmp/main-tree] [--profile PREFIX] [--kept]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ipc_common import CHANNELS, PREFIXES, cpu_ns, make_data_dir
from ipc_floor import Child, kinds

PROBE = Path(__file__).resolve().parent / "cost_probe.py"


def breakdown(path: Path, n: int) -> dict[str, float]:
    """The probes' totals (cost_probe.py) as microseconds a command, with each piece's rest
    (what it spent outside the pieces under it) and the main thread's CPU in all."""
    got = json.loads(path.read_text())
    us = {k: v["ns"] / n / 1000 for k, v in got["pieces"].items()}
    out = {"main_thread": got["main_cpu_ns"] / n / 1000}
    for k in sorted(us):
        out[k] = us[k]
        under = sum(v for c, v in us.items() if c.startswith(k + "/") and "/" not in c[len(k) + 1:])
        if under:
            out[k + "/rest"] = us[k] - under
    out["outside_turns"] = out["main_thread"] - sum(
        v for k, v in us.items() if "/" not in k)
    return {k: round(v, 1) for k, v in out.items()}


def run(args: argparse.Namespace, label: str, kind: str, tree: Path) -> dict[str, Any]:
    n = int(args.rate * args.seconds)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        groups = [f"g{i:03d}" for i in range(args.groups)]
        cfg = make_data_dir(root, len(groups), tree, PREFIXES[args.channel])
        ipc = root / "data" / "ipc"
        probe_out = root / "probe.json"
        probing = args.breakdown and kind == "mdclaw"
        child = Child(kind, cfg, groups, tree, args.channel, log=args.log, env={
            "MDCLAW_BENCH_PRELOAD": str(PROBE), "MDCLAW_BENCH_PROBE_OUT": str(probe_out)}
            if probing else None)
        late = 0.0
        try:
            time.sleep(1.0)  # start-up work done (snapshots, first poll tick)
            spy = None
            if args.profile and kind == "mdclaw":
                spy = subprocess.Popen(["py-spy", "record", "-p", str(child.pid), "-r", "1000",
                                        "--threads", "--format", "raw", "-o",
                                        f"{args.profile}-{label}.txt"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
            if probing:
                os.kill(child.pid, signal.SIGUSR1)
            cpu0 = cpu_ns(child.pid)
            t0 = time.monotonic()
            for i in range(n):
                due = t0 + i / args.rate
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late = max(late, -wait)
                name = f"{time.time_ns():019d}-s{i:06d}.json"
                d = ipc / groups[i % len(groups)] / "messages"
                tmp_file = d / f".{name}.tmp"
                with open(tmp_file, "w") as f:
                    f.write(json.dumps({"type": "message", "text": name}))
                os.rename(tmp_file, d / name)
            child.wait_done(n)
            cpu = (cpu_ns(child.pid) - cpu0) / 1e9
            if probing:
                os.kill(child.pid, signal.SIGUSR2)
            wall = time.monotonic() - t0
            child.wait_settled()
            settled = (cpu_ns(child.pid) - cpu0) / 1e9
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait()
        finally:
            child.stop()
        parts = breakdown(probe_out, n) if probing else None
    out: dict[str, Any] = {"cpu_us": cpu / n * 1e6, "cpu_settled_us": settled / n * 1e6,
                           "wall_s": wall, "writer_late_max_ms": late * 1000}
    if parts is not None:
        out["breakdown_us"] = parts
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=20.0, help="commands a second")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kept", action="store_true",
                    help="also the floor plus what mdclaw keeps (bench/ipc_floor.py's kept)")
    ap.add_argument("--before", default=None, help="another tree's mdclaw, run beside")
    ap.add_argument("--profile", default=None,
                    help="py-spy (on PATH) samples mdclaw's child into PREFIX-<label>.txt")
    ap.add_argument("--root", default=None, help="where the data dirs go (default: $TMPDIR)")
    ap.add_argument("--channel", choices=sorted(CHANNELS), default="bench",
                    help="mdclaw's chat service: a recording one, or the local HTTP channel")
    ap.add_argument("--log", action="store_true",
                    help="mdclaw's child logs as `mdclaw run` does (INFO lines, to a file)")
    ap.add_argument("--breakdown", action="store_true",
                    help="where mdclaw's main thread spends its CPU (bench/cost_probe.py)")
    args = ap.parse_args()
    rounds = []
    for r in range(args.rounds):
        res = {lbl: run(args, lbl, kind, tree) for lbl, kind, tree in kinds(args)}
        rounds.append(res)
        print(json.dumps({"mode": "steady", "round": r + 1, "channel": args.channel,
                          "rate": args.rate,
                          "groups": args.groups,
                          **{lbl: {k: v if isinstance(v, dict) else round(v, 2)
                                   for k, v in f.items()} for lbl, f in res.items()}}),
              flush=True)
    med = {lbl: statistics.median(r[lbl]["cpu_us"] for r in rounds) for lbl in rounds[0]}
    settled = {lbl: statistics.median(r[lbl]["cpu_settled_us"] for r in rounds)
               for lbl in rounds[0]}
    print(json.dumps({"mode": "steady", "median_of_rounds": args.rounds,
                      "channel": args.channel, "rate": args.rate,
                      "groups": args.groups, "commands": int(args.rate * args.seconds),
                      "fs": args.root or tempfile.gettempdir(),
                      "load": round(os.getloadavg()[0], 1),
                      "cpu_us": {k: round(v, 1) for k, v in med.items()},
                      "ratios": {lbl: round(v / med["floor"], 3) for lbl, v in med.items()
                                 if lbl != "floor"},
                      "cpu_settled_us": {k: round(v, 1) for k, v in settled.items()},
                      "settled_ratios": {lbl: round(v / settled["floor"], 3)
                                         for lbl, v in settled.items() if lbl != "floor"}}),
          flush=True)
    if args.breakdown:
        for lbl in rounds[0]:
            if "breakdown_us" not in rounds[0][lbl]:
                continue  # the floors
            keys = sorted({k for r in rounds for k in r[lbl]["breakdown_us"]})
            print(json.dumps({"mode": "steady", "breakdown_median_of_rounds": args.rounds,
                              "label": lbl, "rate": args.rate, "us_per_command": {
                                  k: round(statistics.median(
                                      r[lbl]["breakdown_us"].get(k, 0.0) for r in rounds), 1)
                                  for k in keys}}), flush=True)


if __name__ == "__main__":
    main()
