"""The durable floor of a command file, and mdclaw measured against it on the same work.

The floor is the least a host can do and still keep a command once it is read: one process,
inotify on every group's `messages/` and `tasks/`, and for what one wake-up reports: open,
read, `json.loads`, INSERT (one `executemany`), COMMIT (SQLite WAL, `synchronous=NORMAL`, as
mdclaw's), unlink. No checks, no ledger, no delivery. mdclaw is the real IPC loop and the real
OutboxWorker on one event loop, as in the daemon (`ipc_flood.py`'s server), with a channel
that records when its `send_message` is entered. Both run in a child process of their own,
one after the other, over fresh data dirs, so every ratio compares figures of the same run.

    python bench/ipc_floor.py burst [--groups 10] [--commands 2000] [--rounds 3]
    python bench/ipc_floor.py burst --single [--commands 2000]     # one flooded folder
    python bench/ipc_floor.py latency [--samples 500] [--rounds 3]
    python bench/ipc_floor.py ... --before /tmp/main-tree          # also that tree's mdclaw
    python bench/ipc_floor.py ... --kept     # also the floor plus what mdclaw keeps (FLOOR_KEPT)
    python bench/ipc_floor.py ... --channel http    # mdclaw delivers to the local chat page
    python bench/ipc_floor.py ... --log    # mdclaw's child logs as `mdclaw run` (INFO lines)

`burst`: every command staged as a dot-file, then renamed in as fast as possible; CPU of the
child per command, commands/s committed (last commit - first rename) and, for mdclaw,
delivered (last send call - first rename). `cpu_us` is the CPU until the last command is
done; `cpu_settled_us` adds what mdclaw put off until after it (the transcript's index
batch, the WAL checkpoint down to SQLite's own threshold, which the floor's commits keep),
`settle_s` how long that took. `latency`: one `message` at a time into a random
group of 100, renamed, waited for (file gone), 5 ms apart: rename -> COMMIT and, for mdclaw,
rename -> send call. A commit's time is taken as its COMMIT returns, in both. Each round
runs the floor, then mdclaw (then `--before`'s); the last line is the median over rounds of
each figure and its ratio to the floor's. See also ipc_steady.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ipc_common import (
    CHANNELS,
    PREFIXES,
    RECORDING,
    REPO,
    Removals,
    cpu_ns,
    make_data_dir,
    stage,
    stop,
)

# WAL frames not yet in the database at which a burst's work counts as settled: SQLite's
# default auto-checkpoint (the floor's connection checkpoints past it, on its own commits).
SETTLED_FRAMES = 1000

FLOOR = """
import json, os, signal, sqlite3, sys, time
from inotify_simple import INotify, flags as F
ipc, groups = {ipc!r}, {groups!r}
db = sqlite3.connect({db!r}, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=NORMAL")
db.execute("CREATE TABLE IF NOT EXISTS floor (id INTEGER PRIMARY KEY, folder TEXT, name TEXT,"
           " type TEXT, body TEXT)")
ino = INotify()
dirs = {{}}
for g in groups:
    for sub in ("messages", "tasks"):
        p = os.path.join(ipc, g, sub)
        dirs[ino.add_watch(p, F.CLOSE_WRITE | F.MOVED_TO)] = (g, p)
commits, stopping = {{}}, []
signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
print("ready", flush=True)
while not stopping:
    try:
        events = ino.read(timeout=200)
    except InterruptedError:
        continue
    files = [(dirs[e.wd], e.name) for e in events
             if e.name.endswith(".json") and not e.name.startswith(".")]
    if not files:
        continue
    rows = []
    for (g, d), name in files:
        with open(os.path.join(d, name), "rb") as f:
            body = json.loads(f.read())
        rows.append((g, name, body.get("type"), body.get("text")))
    db.execute("BEGIN")
    db.executemany("INSERT INTO floor (folder, name, type, body) VALUES (?, ?, ?, ?)", rows)
    db.execute("COMMIT")
    now = time.monotonic_ns()
    for (g, d), name in files:
        commits[name] = now
        os.unlink(os.path.join(d, name))
db.close()
with open({out!r}, "w") as f:
    json.dump({{"commits": commits, "sends": {{}}}}, f)
"""

# The floor plus what mdclaw must keep of a `message` command, in mdclaw's own database
# (its schema, triggers and indexes, as make_data_dir migrated it) and with no other code:
# per wake-up, the files read (with fstat, for the ledger key's generation) and hashed;
# one transaction that looks the files up in the ledger, writes each message's outbox row
# claimed (`sending`) and each file's ledger row; then each message "sent" (its time
# recorded, as mdclaw's recording channel does); then one transaction of the `sent` marks;
# then the unlinks. What the exactly-once ledger, the outbox's states and the transcript's
# queue cost at least, in SQLite and system calls: `--kept` runs it as a third child.
FLOOR_KEPT = """
import hashlib, json, os, signal, sqlite3, sys, time
from inotify_simple import INotify, flags as F
ipc, groups = {ipc!r}, {groups!r}
db = sqlite3.connect({db!r}, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=NORMAL")
db.execute("PRAGMA foreign_keys=ON")
chat = {{g: r[0] for g, r in ((g, db.execute(
    "SELECT jid FROM group_chats WHERE folder = ?", (g,)).fetchone()) for g in groups)}}
ino = INotify()
dirs = {{}}
for g in groups:
    for sub in ("messages", "tasks"):
        p = os.path.join(ipc, g, sub)
        dirs[ino.add_watch(p, F.CLOSE_WRITE | F.MOVED_TO)] = (g, sub, p)
commits, sends, stopping = {{}}, {{}}, []
signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
OUTBOX = ("INSERT INTO outbox (chat_jid, kind, text, sender, source_group, status, attempts,"
          " next_attempt_at, created_at, updated_at) VALUES (?, 'text', ?, NULL, ?, 'sending',"
          " 1, ?, ?, ?)")
LEDGER = ("INSERT INTO ipc_ledger (group_folder, file_name, content_hash, command_type,"
          " outcome, detail, processed_at) VALUES (?, ?, ?, 'message', 'applied', NULL, ?)")
SENT = ("UPDATE outbox SET status = 'sent', sent_at = ?, updated_at = ?,"
        " next_attempt_at = NULL WHERE id = ?")
print("ready", flush=True)
while not stopping:
    try:
        events = ino.read(timeout=200)
    except InterruptedError:
        continue
    files = [(dirs[e.wd], e.name) for e in events
             if e.name.endswith(".json") and not e.name.startswith(".")]
    if not files:
        continue
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000+00:00", time.gmtime())
    rows = []
    for (g, sub, d), name in files:
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
        st = os.fstat(fd)
        data = os.read(fd, 1 << 20)
        os.close(fd)
        key = hashlib.sha256(data).hexdigest() + "@" + str(st.st_ino)
        rows.append((g, sub + "/" + name, key, json.loads(data), name, os.path.join(d, name)))
    db.execute("BEGIN IMMEDIATE")
    by = {{}}
    for r in rows:
        by.setdefault(r[0], []).append(r[1])
    for g, names in by.items():
        db.execute("SELECT file_name, content_hash, outcome, detail FROM ipc_ledger WHERE "
                   "group_folder = ? AND file_name IN (" + ",".join("?" * len(names)) + ")",
                   (g, *names)).fetchall()
    ids = [db.execute(OUTBOX, (chat[g], body.get("text"), g, now, now, now)).lastrowid
           for g, _, _, body, _, _ in rows]
    db.executemany(LEDGER, [(g, fn, key, now) for g, fn, key, _, _, _ in rows])
    db.execute("COMMIT")
    t = time.monotonic_ns()
    for r in rows:
        commits[r[4]] = t
    for r in rows:
        sends[r[4]] = time.monotonic_ns()
    db.execute("BEGIN IMMEDIATE")
    db.executemany(SENT, [(now, now, i) for i in ids])
    db.execute("COMMIT")
    for r in rows:
        os.unlink(r[5])
db.close()
with open({out!r}, "w") as f:
    json.dump({{"commits": commits, "sends": sends}}, f)
"""

MDCLAW = """
import asyncio, json, os, signal, sys, time
sys.path.insert(0, {repo!r})
if os.environ.get("MDCLAW_BENCH_PRELOAD"):  # a measuring hook (timed statements...)
    exec(open(os.environ["MDCLAW_BENCH_PRELOAD"]).read())
if os.environ.get("MDCLAW_BENCH_LOG"):  # log as `mdclaw run` does: INFO, one line a record
    import logging
    from mdclaw.cli import JournalFormatter
    _handler = logging.StreamHandler(open(os.environ["MDCLAW_BENCH_LOG"], "w"))
    _handler.setFormatter(JournalFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[_handler])
from mdclaw.channels.base import Channel
from mdclaw.config import load_config
from mdclaw.state import Database
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.outbox import OutboxWorker
cfg = load_config({cfg!r})
commits, sends = {{}}, {{}}

{recording}
{channels}
async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    db = Database(cfg.db_path)
    # A round's commit time is taken as its COMMIT returns, as the floor's (on_commit comes
    # later: after the rows are handed to the outbox, whose `sent` marks may be written by
    # then): the first end() of each round's process().
    committed, in_round = [0], [False]
    real_end = db.end
    def end(*, commit):
        real_end(commit=commit)
        if in_round[0]:
            in_round[0] = False
            committed[0] = time.monotonic_ns()
    db.end = end
    channels, on_sent = await make_channels(db)
    outbox = OutboxWorker(db, channels, on_sent=on_sent)
    w = IpcWatcher(cfg, db)
    real_process = w.engine.process
    def process(batch):
        in_round[0] = True
        return real_process(batch)
    w.engine.process = process
    def on_commit(items):
        now = committed[0]
        for it in items:
            commits[it.name] = now
        # As the daemon: rows handed to the worker need no look of its own (a tree
        # without the hand-off has no `direct`: the outbox looks after every commit).
        if not all(getattr(it, "direct", None) is not None for it in items):
            outbox.wake()
    w.engine.on_commit = on_commit
    w.engine.outbox = outbox  # trees that hand rows to the worker directly take it
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
if os.environ.get("MDCLAW_BENCH_CPROFILE"):  # a deterministic profile of the loop
    import cProfile
    cProfile.run("asyncio.run(main())", os.environ["MDCLAW_BENCH_CPROFILE"])
else:
    asyncio.run(main())
"""


class Child:
    """A floor or an mdclaw server over the data dir of `cfg_path`, in a child process."""

    def __init__(self, kind: str, cfg_path: Path, groups: list[str], repo: Path = REPO,
                 channel: str = "bench", log: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.kind = kind
        root = cfg_path.parent
        self.out = root / f"{kind}-{time.monotonic_ns()}.json"
        self.ipc = root / "data" / "ipc"
        self.db = root / "data" / "state.db"
        if kind == "floor":
            self.floor_db = root / "floor.db"
            code = FLOOR.format(ipc=str(self.ipc), groups=groups, db=str(self.floor_db),
                                out=str(self.out))
        elif kind == "kept":
            code = FLOOR_KEPT.format(ipc=str(self.ipc), groups=groups, db=str(self.db),
                                     out=str(self.out))
        else:
            code = MDCLAW.format(repo=str(repo), cfg=str(cfg_path), out=str(self.out),
                                 recording=RECORDING, channels=CHANNELS[channel])
        # `env`: variables of mdclaw's child (a measuring hook: MDCLAW_BENCH_PRELOAD).
        child_env = {**os.environ, "PYTHONPATH": str(repo)}
        if kind != "floor":
            child_env.update(env or {})
            if log:
                child_env["MDCLAW_BENCH_LOG"] = str(root / f"{kind}-{time.monotonic_ns()}.log")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                     text=True, env=child_env, cwd=str(repo))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", line
        self.pid = self.proc.pid

    def count_done(self, conn: object) -> int:
        """Commands finished: committed (floor) or delivered (mdclaw)."""
        sql = ("SELECT count(*) FROM floor" if self.kind == "floor" else
               "SELECT count(*) FROM outbox WHERE status = 'sent'")
        return int(conn.execute(sql).fetchone()[0])  # type: ignore[attr-defined]

    def wait_done(self, n: int, timeout: float = 600) -> None:
        import sqlite3
        path = self.floor_db if self.kind == "floor" else self.db
        deadline = time.monotonic() + timeout
        conn = sqlite3.connect(path, timeout=30)
        try:
            while time.monotonic() < deadline:
                try:
                    if self.count_done(conn) >= n:
                        return
                except sqlite3.OperationalError:
                    pass  # the floor's table is not made yet
                time.sleep(0.02)
        finally:
            conn.close()
        raise TimeoutError(f"{self.kind}: {n} commands")

    def wait_settled(self, timeout: float = 60) -> None:
        """Wait until the work mdclaw put off during the run is done: the transcript rows
        queued for the full-text index (and replies for their transcript row) taken, and
        fewer than SETTLED_FRAMES WAL frames not yet copied into the database (SQLite's own
        auto-checkpoint threshold, which the floor's commits follow: mdclaw's checkpoints
        wait for a quiet moment on another thread). The floor puts nothing off; the kept
        floor leaves its replies queued for a transcript indexer it does not run."""
        if self.kind in ("floor", "kept"):
            return
        from mdclaw.state import Database
        deadline = time.monotonic() + timeout
        db = Database(self.db, migrate=False)
        try:
            tables = {r[0] for r in db.query("SELECT name FROM sqlite_master")}
            queues = [t for t in ("transcript_unindexed", "transcript_replies_queued")
                      if t in tables]
            while time.monotonic() < deadline:
                queued = sum(db.scalar(f"SELECT count(*) FROM {t}")  # noqa: S608 - two names above
                             for t in queues)
                frames, done = db.wal_frames() or (0, 0)
                if not queued and frames - done < SETTLED_FRAMES:
                    return
                time.sleep(0.02)
        finally:
            db.close()
        raise TimeoutError(f"{self.kind}: the index queue or the WAL did not settle")

    def stop(self) -> dict[str, dict[str, int]]:
        stop(self.proc)
        return json.loads(self.out.read_text())


def kinds(args: argparse.Namespace) -> list[tuple[str, str, Path]]:
    """(label, kind, tree) of what each round runs, the floor first."""
    out = [("floor", "floor", REPO), ("mdclaw", "mdclaw", REPO)]
    if args.kept:
        out.insert(1, ("kept", "kept", REPO))
    if args.before:
        out.append(("before", "mdclaw", Path(args.before)))
    return out


def _name(tag: str, i: int) -> str:
    return f"{time.time_ns():019d}-{tag}{i:06d}.json"


def run_burst(args: argparse.Namespace, label: str, kind: str, tree: Path) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        groups = [f"g{i:03d}" for i in range(max(args.groups, 2))]
        cfg = make_data_dir(root, len(groups), tree, PREFIXES[args.channel])
        ipc = root / "data" / "ipc"
        child = Child(kind, cfg, groups, tree, args.channel, log=args.log)
        try:
            staged = []
            for i in range(args.commands):
                g = groups[1] if args.single else groups[i % len(groups)]
                name = _name("b", i)
                final = ipc / g / "messages" / name
                staged.append((stage(final, {"type": "message", "text": name}), final))
            cpu0 = cpu_ns(child.pid)
            first = time.monotonic_ns()
            for tmp_file, final in staged:
                os.rename(tmp_file, final)
            child.wait_done(args.commands)
            cpu = (cpu_ns(child.pid) - cpu0) / 1e9
            done_at = time.monotonic()
            child.wait_settled()
            settle_s = time.monotonic() - done_at
            settled = (cpu_ns(child.pid) - cpu0) / 1e9
        finally:
            res = child.stop()
    want = {final.name for _, final in staged}
    commits = [t for n, t in res["commits"].items() if n in want]
    assert len(commits) == args.commands, (label, len(commits))
    out = {"cpu_us": cpu / args.commands * 1e6,
           "cpu_settled_us": settled / args.commands * 1e6, "settle_s": settle_s,
           "committed_per_s": args.commands / ((max(commits) - first) / 1e9)}
    if kind != "floor":
        sends = [t for n, t in res["sends"].items() if n in want]
        assert len(sends) == args.commands, (label, len(sends))
        out["delivered_per_s"] = args.commands / ((max(sends) - first) / 1e9)
    return out


def run_latency(args: argparse.Namespace, label: str, kind: str, tree: Path
                ) -> dict[str, float]:
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        groups = [f"g{i:03d}" for i in range(args.groups)]
        cfg = make_data_dir(root, len(groups), tree, PREFIXES[args.channel])
        ipc = root / "data" / "ipc"
        child = Child(kind, cfg, groups, tree, args.channel, log=args.log)
        renamed: dict[str, int] = {}
        try:
            removals = Removals([ipc / g / "messages" for g in groups])
            for i in range(args.samples):
                g = rng.choice(groups)
                name = _name("l", i)
                final = ipc / g / "messages" / name
                tmp_file = stage(final, {"type": "message", "text": name})
                renamed[name] = time.monotonic_ns()
                tmp_file.rename(final)
                removals.wait_for(name)
                time.sleep(args.gap)
            child.wait_done(args.samples)
        finally:
            res = child.stop()
    out: dict[str, float] = {}
    for what in ("commits", "sends"):
        if kind == "floor" and what == "sends":
            continue
        xs = sorted((res[what][n] - t) / 1e6 for n, t in renamed.items())
        assert len(xs) == args.samples, (label, what, len(xs))
        out[f"{what[:-1]}_p50_ms"] = statistics.median(xs)
        out[f"{what[:-1]}_p99_ms"] = xs[max(0, int(len(xs) * 0.99) - 1)]
    return out


def report(mode: str, rounds: list[dict[str, dict[str, float]]], common: dict[str, object]
           ) -> None:
    """One line per round, then the medians and the ratios to the floor's medians."""
    for i, r in enumerate(rounds):
        print(json.dumps({"mode": mode, "round": i + 1, **common,
                          **{lbl: {k: round(v, 4) for k, v in figs.items()}
                             for lbl, figs in r.items()}}), flush=True)
    med: dict[str, dict[str, float]] = {}
    for lbl in rounds[0]:
        med[lbl] = {k: statistics.median(r[lbl][k] for r in rounds) for k in rounds[0][lbl]}
    ratios: dict[str, dict[str, float]] = {}
    floor = med["floor"]
    for lbl, figs in med.items():
        if lbl == "floor":
            continue
        rr: dict[str, float] = {}
        if "cpu_us" in figs:
            rr["cpu_x_floor"] = figs["cpu_us"] / floor["cpu_us"]
        if "cpu_settled_us" in figs:
            rr["cpu_settled_x_floor"] = figs["cpu_settled_us"] / floor["cpu_settled_us"]
        if "delivered_per_s" in figs:
            rr["delivered_x_floor_committed"] = figs["delivered_per_s"] / floor["committed_per_s"]
            rr["committed_x_floor"] = figs["committed_per_s"] / floor["committed_per_s"]
        for p in ("p50", "p99"):
            if f"commit_{p}_ms" in figs:
                rr[f"commit_{p}_x_floor"] = figs[f"commit_{p}_ms"] / floor[f"commit_{p}_ms"]
                rr[f"send_{p}_x_floor"] = figs[f"send_{p}_ms"] / floor[f"commit_{p}_ms"]
        ratios[lbl] = {k: round(v, 3) for k, v in rr.items()}
    print(json.dumps({"mode": mode, "median_of_rounds": len(rounds), **common,
                      **{lbl: {k: round(v, 4) for k, v in figs.items()}
                         for lbl, figs in med.items()}, "ratios": ratios}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("burst", "latency"))
    ap.add_argument("--groups", type=int, default=None,
                    help="groups (default: 10 for burst, 100 for latency)")
    ap.add_argument("--single", action="store_true", help="burst: one folder gets everything")
    ap.add_argument("--commands", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--gap", type=float, default=0.005)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kept", action="store_true",
                    help="also the floor plus what mdclaw keeps (ledger, outbox states)")
    ap.add_argument("--before", default=None, help="another tree's mdclaw, run beside")
    ap.add_argument("--root", default=None, help="where the data dirs go (default: $TMPDIR)")
    ap.add_argument("--channel", choices=sorted(CHANNELS), default="bench",
                    help="mdclaw's chat service: a recording one, or the local HTTP channel")
    ap.add_argument("--log", action="store_true",
                    help="mdclaw's child logs as `mdclaw run` does (INFO lines, to a file)")
    args = ap.parse_args()
    if args.groups is None:
        args.groups = 10 if args.mode == "burst" else 100
    run = run_burst if args.mode == "burst" else run_latency
    rounds = []
    for _ in range(args.rounds):
        rounds.append({lbl: run(args, lbl, kind, tree) for lbl, kind, tree in kinds(args)})
    common: dict[str, object] = {"channel": args.channel,
                                 "groups": 1 if args.single else args.groups,
                                 "fs": args.root or tempfile.gettempdir(),
                                 "load": round(os.getloadavg()[0], 1)}
    if args.mode == "burst":
        common["commands"] = args.commands
    else:
        common["samples"] = args.samples
    report(args.mode, rounds, common)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main()
