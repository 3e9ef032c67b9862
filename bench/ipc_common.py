"""Shared set-up for the IPC benchmarks: a data dir with N groups, the real IPC loop in a
child process, and a clock for "file removed" (the engine removes a file only after the
transaction that applied it has committed, so rename -> removal bounds rename -> commit from
above)."""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from inotify_simple import INotify  # noqa: E402
from inotify_simple import flags as F  # noqa: E402

RECONCILE = """
import sys
sys.path.insert(0, {repo!r})
from mdclaw.config import load_config
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
cfg = load_config({cfg!r})
with Database(cfg.db_path) as db:
    reconcile(cfg, db)
"""


def make_data_dir(root: Path, groups: int, tree: Path = REPO, prefix: str = "tg:") -> Path:
    """Write config.yaml for `groups` groups (g000 is main; their chats `prefix`N) and
    reconcile it with `tree`'s mdclaw (an older tree run beside, `--before`, refuses a
    database of a newer schema); returns its path."""
    lines = [f"data_dir: {root / 'data'}", "assistant: {name: Andy, timezone: UTC}",
             "limits: {errors_max_files: 100000}", "groups:"]
    for i in range(groups):
        main = ", main: true" if i == 0 else ""
        lines.append(f"  g{i:03d}: {{name: G{i}, jid: '{prefix}{i}'{main}}}")
    cfg_path = root / "config.yaml"
    cfg_path.write_text("\n".join(lines) + "\n")
    if tree != REPO:
        subprocess.run([sys.executable, "-c", RECONCILE.format(repo=str(tree), cfg=str(cfg_path))],
                       check=True)
        return cfg_path
    from mdclaw.config import load_config
    from mdclaw.reconcile import reconcile
    from mdclaw.state import Database

    cfg = load_config(cfg_path)
    with Database(cfg.db_path) as db:
        reconcile(cfg, db)
    return cfg_path


SERVE = """
import asyncio, json, signal, sys, time
sys.path.insert(0, {repo!r})
from mdclaw.config import load_config
from mdclaw.state import Database
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.integrations import load_all
load_all()
cfg = load_config({cfg!r})
commits = {{}}
def on_commit(items):
    now = time.monotonic_ns()
    for it in items:
        commits[it.name] = now
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    w = IpcWatcher(cfg, Database(cfg.db_path), use_inotify={inotify}, poll_interval={poll})
    w.engine.on_commit = on_commit
    t = asyncio.create_task(w.run(stop))
    while not w.idle.is_set():
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    await t
    w.close()
    with open({commits_file!r}, "w") as f:
        json.dump(commits, f)
asyncio.run(main())
"""


class Server:
    """The real IPC loop in a child process, recording when each file's batch committed
    (CLOCK_MONOTONIC, comparable across processes)."""

    def __init__(self, cfg_path: Path, *, inotify: bool = True, poll: float = 1.0,
                 template: str = SERVE) -> None:
        self.commits_file = cfg_path.parent / f"commits-{time.monotonic_ns()}.json"
        code = template.format(repo=str(REPO), cfg=str(cfg_path), inotify=inotify, poll=poll,
                               commits_file=str(self.commits_file))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line
        self.pid = self.proc.pid

    def stop(self) -> dict[str, int]:
        """Stop it; returns {file name: commit time in ns}."""
        stop(self.proc)
        return json.loads(self.commits_file.read_text())


def serve(cfg_path: Path, *, inotify: bool = True, poll: float = 1.0) -> Server:
    """Start the real IPC loop in a child process; returns once it is idle and watching."""
    return Server(cfg_path, inotify=inotify, poll=poll)


def stop(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ns(pid: int) -> int:
    """CPU time of process `pid`'s live threads so far, in ns (the scheduler's own count,
    /proc/<pid>/task/*/schedstat: finer than cpu_seconds' clock ticks, which a trickle of
    commands costing a few hundred microseconds each needs; threads that ended are not in
    it, and the servers measured keep theirs)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class Removals:
    """Timestamps (perf_counter) of command files disappearing from watched folders."""

    def __init__(self, dirs: list[Path]) -> None:
        self.ino = INotify()
        self.wd = {self.ino.add_watch(str(d), F.DELETE | F.MOVED_FROM): d for d in dirs}

    def wait_for(self, name: str, timeout: float = 10.0) -> float:
        deadline = time.perf_counter() + timeout
        while True:
            for ev in self.ino.read(timeout=int(max(0, deadline - time.perf_counter()) * 1000)):
                if ev.name == name:
                    return time.perf_counter()
            if time.perf_counter() > deadline:
                raise TimeoutError(name)


class PauseResume:
    """The commands timed while something else runs: each sample renames a pause_task or
    resume_task for a random group's own task (see one_task_per_group) into its tasks/,
    waits until the file is gone, then `gap` seconds."""

    def __init__(self, ipc: Path, groups: list[str], rng: random.Random, gap: float) -> None:
        self.ipc, self.groups, self.rng, self.gap = ipc, groups, rng, gap
        self.removals = Removals([ipc / g / "tasks" for g in groups])
        self.paused = dict.fromkeys(groups, False)
        self.renamed: dict[str, tuple[str, int]] = {}  # name -> (phase, rename in ns)

    def sample(self, phase: str, timeout: float = 10.0) -> None:
        g = self.rng.choice(self.groups)
        kind = "resume_task" if self.paused[g] else "pause_task"
        self.paused[g] = not self.paused[g]
        name = f"{len(self.renamed) + 1:013d}-{phase}.json"
        tasks = self.ipc / g / "tasks"
        tmp_file = stage(tasks / name, {"type": kind, "taskId": f"t-{g}"})
        self.renamed[name] = (phase, time.monotonic_ns())
        tmp_file.rename(tasks / name)
        self.removals.wait_for(name, timeout=timeout)
        time.sleep(self.gap)

    def commit_ms(self, commits: dict[str, int]) -> dict[str, list[float]]:
        """Rename -> COMMIT in ms, by phase, of the samples `commits` (Server.stop) has."""
        out: dict[str, list[float]] = {}
        for name, (phase, t) in self.renamed.items():
            if name in commits:
                out.setdefault(phase, []).append((commits[name] - t) / 1e6)
        return out


def p50_p99(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    return statistics.median(values), values[max(0, int(len(values) * 0.99) - 1)]


def one_task_per_group(ipc: Path, groups: list[str]) -> None:
    """Give each group one task (`t-<group>`), as command files the loop applies at start."""
    for g in groups:
        stage(ipc / g / "tasks" / "0-setup.json",
              {"type": "schedule_task", "taskId": f"t-{g}", "prompt": "p",
               "schedule_type": "cron", "schedule_value": "0 8 * * *"}).rename(
            ipc / g / "tasks" / "0-setup.json")


def stage(path: Path, body: dict) -> Path:
    """Write a command as a dot-file (ignored by the engine) ready to be renamed in."""
    tmp = path.parent / f".{path.name}.tmp"
    tmp.write_text(json.dumps(body))
    return tmp


def emit(figure: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"figure": figure, "value": round(value, 4), "unit": unit, **extra}),
          flush=True)


# The channel the served IPC loops deliver to, as source text for their child process
# (`{recording}` in a template): it records when each text reached `send_message`, in the
# child's `sends`.
# The chat service of the mdclaw child (`--channel`): an `async def make_channels(db)`
# returning (the channels, the outbox worker's on_sent). `bench`: a channel that records
# when its send is called; `http`: the local HTTP channel (the chat page, the embedded
# default) on a loopback port, a delivery's time taken as its `sent` mark commits.
CHANNELS = {
    "bench": """
async def make_channels(db):
    return [Recording()], None
""",
    "http": """
async def make_channels(db):
    from mdclaw.channels.http import HttpChannel
    from mdclaw.webserver import TokenGate, WebServer
    ch = HttpChannel(db, WebServer("127.0.0.1:0", TokenGate(None)))
    await ch.server.start()
    await ch.connect()
    def on_sent(row):
        sends[row.text] = time.monotonic_ns()
    return [ch], on_sent
""",
}
PREFIXES = {"bench": "tg:", "http": "hl:"}

RECORDING = """class Recording(Channel):
    name = "bench"
    jid_prefix = "tg:"
    async def connect(self): ...
    async def disconnect(self): ...
    def is_connected(self): return True
    async def send_message(self, jid, text, *, reply_to=None, sender=None):
        sends[text] = time.monotonic_ns()
    async def send_file(self, *a, **kw): return None
    async def react(self, *a, **kw): return None
    async def set_typing(self, *a, **kw): return None
"""
