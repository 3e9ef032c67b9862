"""Host-side latency of the daemon's two hot paths, and its idle memory.

1. `ipc_to_send_call`: an agent's send_message file renamed into ipc/<group>/messages/ until
   the channel's send_message is called — the real IpcWatcher (inotify) and OutboxWorker,
   in one event loop as in the daemon, with a channel that records the call time.
2. `inbound_to_start_call`: an inbound chat message handed to the orchestrator until the
   container engine is asked to start the container — the real Orchestrator, GroupQueue,
   ContainerRunner and DockerRuntime against a live engine (needs DOCKER_HOST or a running
   Podman service and the `mdclaw-agent:e2e` image; skipped with a note otherwise).
3. `idle_rss_mb`: resident memory of `mdclaw run` with 100 groups (`--groups`) after 12 s;
   with `--idle-seconds S`, also the daemon's CPU over the S seconds after that
   (`idle_cpu_s`); with `--tasks N`, N active tasks (none due for a day) are in the
   database before the daemon starts.

Prints one JSON object per figure. Usage: python bench/daemon_paths.py [--n 200]
[--only idle] [--groups 100] [--idle-seconds 0] [--tasks 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mdclaw.channels.base import Channel, InboundMessage  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.reconcile import reconcile  # noqa: E402
from mdclaw.state import Database  # noqa: E402


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def emit(name: str, values: list[float], **extra: object) -> None:
    print(json.dumps({"figure": name, "unit": "ms", "n": len(values),
                      "p50": round(statistics.median(values), 3),
                      "p99": round(pct(values, 99), 3), "max": round(max(values), 3),
                      **extra}), flush=True)


def write_config(tmp: Path, groups: int, extra: str = "") -> Path:
    lines = [f"data_dir: {tmp / 'data'}", "groups:"]
    for i in range(groups):
        lines.append(f"  g{i}: {{name: G{i}, jid: 'hl:g{i}'{', main: true' if i == 0 else ''}}}")
    p = tmp / "config.yaml"
    p.write_text("\n".join(lines) + "\n" + extra)
    return p


class Recorder(Channel):
    name = "bench"
    jid_prefix = "hl:"

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, float] = {}
        self.got = asyncio.Event()

    async def connect(self) -> None: ...
    async def disconnect(self) -> None: ...
    def is_connected(self) -> bool:
        return True

    async def send_message(self, jid: str, text: str, *, reply_to=None, sender=None) -> None:  # noqa: ANN001
        self.calls[text] = time.perf_counter()
        self.got.set()

    async def send_file(self, jid, path, *, file_name=None, caption=None) -> None:  # noqa: ANN001
        ...

    async def react(self, jid: str, message_id: str, emoji: str) -> None: ...
    async def set_typing(self, jid: str, typing: bool) -> None: ...


async def ipc_to_send(n: int) -> None:
    from mdclaw.ipc.watcher import IpcWatcher
    from mdclaw.outbox import OutboxWorker

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = load_config(write_config(tmp, 100))
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        ch = Recorder()
        outbox = OutboxWorker(db, [ch])
        watcher = IpcWatcher(cfg, db)
        watcher.engine.on_commit = lambda items: outbox.wake()
        stop = asyncio.Event()
        await outbox.start()
        task = asyncio.create_task(watcher.run(stop))
        await asyncio.sleep(0.5)
        lat = []
        msgs = cfg.data_dir / "ipc" / "g7" / "messages"
        for i in range(n):
            text = f"bench {i}"
            body = json.dumps({"type": "message", "chat_jid": "hl:g7", "text": text}).encode()
            tmpf = msgs / f".{i}.tmp"
            tmpf.write_bytes(body)
            t0 = time.perf_counter()
            os.rename(tmpf, msgs / f"{time.time_ns()}-{i}.json")
            while text not in ch.calls:
                ch.got.clear()
                await asyncio.wait_for(ch.got.wait(), 10)
            lat.append((ch.calls[text] - t0) * 1000)
            await asyncio.sleep(0.005)
        stop.set()
        await task
        watcher.close()
        await outbox.stop()
        db.close()
    emit("ipc_to_send_call", lat, groups=100)


async def inbound_to_start(n: int) -> None:
    from mdclaw.orchestrator import Orchestrator
    from mdclaw.runner import ContainerRunner
    from mdclaw.runtime import EngineUnavailable, create_runtime

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = load_config(write_config(tmp, 10, extra=(
            "runtime: {image: 'mdclaw-agent:e2e', install_id: bench-daemon}\n"
            "limits: {run_attempts: 1, memory: 128m, pids: 64}\n")))
        rt = create_runtime(cfg.runtime)
        try:
            rt.ping()
            if rt.image_info("mdclaw-agent:e2e") is None:
                raise EngineUnavailable("no mdclaw-agent:e2e image (built by the e2e tests)")
        except EngineUnavailable as e:
            print(json.dumps({"figure": "inbound_to_start_call", "skipped": str(e)}))
            return
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        runner = ContainerRunner(cfg, rt)
        orch = Orchestrator(cfg, db, runner=runner)
        orch.engine_ready.set()
        for i in range(n):
            await orch.on_inbound(InboundMessage(
                id=f"hl:g0:{i}", chat_jid="hl:g0", sender="u", sender_name="U",
                content=f"hi {i}", timestamp=f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}.000Z"))
            await orch.queue.join()
        await runner.aclose()
        rt.cleanup({"mdclaw.install": "bench-daemon"})
        db.close()
    emit("inbound_to_start_call",
         [t["inbound_to_start_call_ms"] for t in orch.timings if "inbound_to_start_call_ms" in t],
         note="host side only: store, trigger, queue, prompt, spec, settings file")


def add_tasks(db_path: Path, n: int, groups: int) -> None:
    """Insert `n` active interval tasks spread over the groups, none due for a day."""
    from datetime import timedelta

    from mdclaw import schedule

    now = schedule.utc_now()
    stamp = schedule.to_iso(now)
    rows = [(f"task-{i:07d}", f"g{i % groups}", f"hl:g{i % groups}", "prompt", "interval",
             "86400000", schedule.to_iso(now + timedelta(seconds=86400 + i * 20)), "active",
             stamp, "ipc", "UTC", 1, stamp) for i in range(n)]
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with Database(db_path) as db, db.transaction() as c:
        c.executemany(
            "INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, schedule_type,"
            " schedule_value, next_run, status, created_at, source, timezone, catch_up,"
            " updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)


def idle_rss(groups: int = 100, idle_seconds: float = 0, tasks: int = 0) -> None:
    def cpu_of(pid: int) -> float:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = write_config(tmp, groups, extra="channels: {http: {listen: '127.0.0.1:0'}}\n"
                           f"runtime: {{socket: 'unix://{tmp}/none.sock'}}\n")
        if tasks:
            add_tasks(tmp / "data" / "state.db", tasks, groups)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        env["PYTHONPATH"] = str(REPO)
        p = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(12)
        rss_kb = 0
        for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
        cpu = cpu_of(p.pid)
        idle_cpu = None
        if idle_seconds:
            time.sleep(idle_seconds)
            idle_cpu = round(cpu_of(p.pid) - cpu, 3)
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb = max(rss_kb, int(line.split()[1]))
        p.terminate()
        p.wait(40)
    print(json.dumps({"figure": "idle_rss_mb", "groups": groups, "value": round(rss_kb / 1024, 1),
                      "cpu_seconds_first_12s": cpu, "idle_cpu_s": idle_cpu,
                      "idle_seconds": idle_seconds, "tasks": tasks,
                      "loadavg": os.getloadavg()[0]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--only", choices=("idle",), default=None)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--idle-seconds", type=float, default=0)
    ap.add_argument("--tasks", type=int, default=0)
    args = ap.parse_args()
    if args.only is None:
        asyncio.run(ipc_to_send(args.n))
        asyncio.run(inbound_to_start(args.runs))
    idle_rss(args.groups, args.idle_seconds, args.tasks)


if __name__ == "__main__":
    main()
