"""The daemon's CPU per turn and per command as its history grows (issues 27 and 35).

A real state.db gets a history: `--messages` inbound messages and as many sent outbox rows
(a tenth as many IPC ledger rows, of the last week: the ledger keeps 7 days; the
transcript rows and their full-text index), spread over `--chats`
chats the way a household's are (a few busy chats, many quiet ones: chat i gets a share
proportional to 1/(i+1)) and over `--years` years. The history is written straight into the
tables (executemany in one transaction, the transcript and its index built in bulk after),
not through the app. Then the daemon's parts run in one event loop as in the daemon: the real
Orchestrator, queue and ContainerRunner (over tests/fake_engine.py's `chat_agent`, whose
containers answer like the agent runner), the real IpcWatcher and OutboxWorker, and a channel
that records what it is asked to send. The same measurement runs first on an empty install
(same chats, no history), then on the filled one, in the same process run.

Each chat's first message opens its conversation (its prompt is the newest messages of the
history; not measured). Then, one at a time, spread over the chats:

- `turn_cpu_ms`: a person's message handed to the orchestrator, fed into the chat's open
  conversation, answered, the answer delivered to the channel;
- `command_cpu_ms`: an agent's `message` command file renamed into ipc/<group>/messages/,
  applied, its outbox row delivered to the channel.

CPU is the process's (every thread: the event loop, its worker threads, the fake containers'
threads), per turn / per command; `wall_p50_ms` is from hand-over to the channel's send call,
`commit_p50_ms` (commands) from the rename to the IPC engine's commit; `reads` is the read
system calls per turn / command (a page SQLite does not hold in its cache is one). The last
line compares the filled database with the empty one, medians of the rounds (target: within
20%). `fill_s` is the time to write the history.

`status`: the daemon's look at the database every 5 s on its event loop (the rows waiting,
failed and sent in the last day; whether the channel's deliveries fail), `look_ms` the median
of 50 looks (a tree before migration 18 counts every row: the bench falls back to what it has).

`store` (`--stores`, default 600): storing an inbound message (store_message) and an
agent's reply (an outbox row), each its own transaction, as the orchestrator and the IPC
engine write them: the CPU of the storing thread alone (`time.thread_time_ns`), medians.

Usage: python bench/history_cost.py [--chats 20] [--messages 1000000] [--years 3]
[--turns 200] [--commands 600] [--stores 600] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from fake_engine import FakeEngine, chat_agent  # noqa: E402
from mdclaw.channels.base import Channel, InboundMessage  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.ipc.watcher import IpcWatcher  # noqa: E402
from mdclaw.ops.health import channel_states  # noqa: E402
from mdclaw.orchestrator import Orchestrator  # noqa: E402
from mdclaw.outbox import OutboxWorker  # noqa: E402
from mdclaw.reconcile import reconcile  # noqa: E402
from mdclaw.runner import ContainerRunner  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.conversations import StoredMessage, store_message  # noqa: E402
from mdclaw.state.outbox import enqueue  # noqa: E402

try:  # what the daemon's status counts (a tree before migration 18: every row's status)
    from mdclaw.state.outbox import recent_outbox_counts as status_counts  # noqa: E402
except ImportError:
    from mdclaw.state.outbox import outbox_counts as status_counts  # noqa: E402


class Recorder(Channel):
    """Records when each text is handed to it."""

    name = "bench"
    jid_prefix = "bn:"

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, float] = {}
        self.got = asyncio.Event()

    async def connect(self) -> None: ...
    async def disconnect(self) -> None: ...

    def is_connected(self) -> bool:
        return True

    async def send_message(self, jid: str, text: str, *, reply_to=None, sender=None) -> None:  # noqa: ANN001
        self.sent[text] = time.perf_counter()
        self.got.set()

    async def send_file(self, *a, **kw) -> None: ...  # noqa: ANN002, ANN003
    async def react(self, *a, **kw) -> None: ...  # noqa: ANN002, ANN003
    async def set_typing(self, *a, **kw) -> None: ...  # noqa: ANN002, ANN003

    async def until(self, text: str, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while text not in self.sent:
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), max(0.01, deadline - time.monotonic()))
        return self.sent[text]


def write_config(tmp: Path, chats: int) -> Path:
    lines = [f"data_dir: {tmp / 'data'}", "assistant: {name: Andy, timezone: UTC}",
             "limits: {run_attempts: 1, idle_timeout: 1h, container_timeout: 2h,"
             f" max_concurrent_containers: {max(chats, 1)}}}", "groups:"]
    for i in range(chats):
        lines.append(f"  g{i}: {{name: G{i}, jid: 'bn:g{i}', requires_trigger: false"
                     f"{', main: true' if i == 0 else ''}}}")
    p = tmp / "config.yaml"
    p.write_text("\n".join(lines) + "\n")
    return p


EPOCH = 1_640_995_200  # 2022-01-01T00:00:00Z


def stamp(t: int) -> str:
    """`t` seconds since the epoch as the database stores times."""
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


def shares(total: int, chats: int) -> list[int]:
    """`total` rows over `chats` chats, chat i's share proportional to 1/(i+1)."""
    weights = [1 / (i + 1) for i in range(chats)]
    counts = [int(total * w / sum(weights)) for w in weights]
    counts[0] += total - sum(counts)
    return counts


def fill(db: Database, chats: int, total: int, years: float) -> None:
    """`total` inbound messages and as many sent outbox rows and IPC ledger rows, over
    `chats` chats and `years` years, written straight into the tables in one transaction;
    their transcript rows and full-text index are built in bulk (the transcript triggers are
    set aside meanwhile and put back as they were). Only columns every schema version since
    migration 12 has, so the same bench runs on the tree before a change."""
    if total <= 0:
        return
    span = int(years * 365 * 86400)
    conn = db.conn
    triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' AND "
                            "tbl_name IN ('messages', 'outbox')").fetchall()
    with db.transaction() as c:
        for name, _sql in triggers:
            c.execute(f'DROP TRIGGER "{name}"')
        for i, n in enumerate(shares(total, chats)):
            jid, folder = f"bn:g{i}", f"g{i}"
            c.execute("INSERT OR IGNORE INTO chats (jid, last_activity, channel) "
                      "VALUES (?, '2022-01-01T00:00:00.000Z', 'bench')", (jid,))
            # Messages come in whole seconds, often several in one (Telegram, WhatsApp).
            times = [stamp(EPOCH + span * k // max(n, 1) // 2 * 2) for k in range(n)]
            c.executemany(
                "INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp) "
                "VALUES (?, ?, 'u', 'U', ?, ?)",
                ((f"{jid}:h{k}", jid, f"what about the weather on day {k}", times[k])
                 for k in range(n)))
            c.executemany(
                "INSERT INTO outbox (chat_jid, kind, text, status, attempts, source_group, "
                "created_at, updated_at, sent_at) VALUES (?, 'text', ?, 'sent', 1, ?, ?, ?, ?)",
                ((jid, f"sunny, {k}", folder, times[k], times[k], times[k]) for k in range(n)))
            # The ledger keeps a week (LEDGER_KEEP): a tenth of the rows, all of this week.
            week = int(time.time()) - 6 * 86400
            c.executemany(
                "INSERT INTO ipc_ledger (group_folder, file_name, content_hash, command_type, "
                "outcome, processed_at) VALUES (?, ?, '', 'message', 'applied', ?)",
                ((folder, f"h{k}.json", stamp(week + k * 5 * 86400 // n))
                 for k in range(0, n, 10)))
        c.execute(
            "INSERT INTO transcript (source, source_id, kind, direction, group_folder, "
            "chat_jid, sender, ts, body) SELECT 'messages', m.id, 'message', 'in', g.folder, "
            "m.chat_jid, 'U', m.timestamp, m.content FROM messages m JOIN registered_groups g "
            "ON g.jid = m.chat_jid ORDER BY m.rowid")
        c.execute(
            "INSERT INTO transcript (source, source_id, kind, direction, group_folder, "
            "chat_jid, ts, body) SELECT 'outbox', CAST(o.id AS TEXT), 'reply', 'out', "
            "o.source_group, o.chat_jid, o.created_at, o.text FROM outbox o ORDER BY o.id")
        c.execute("INSERT INTO transcript_fts (transcript_fts) VALUES ('rebuild')")
        # Every row is indexed now: from migration 17 on, none waits in the index's queue.
        if c.execute("SELECT 1 FROM sqlite_master WHERE name = 'transcript_unindexed'"
                     ).fetchone():
            c.execute("DELETE FROM transcript_unindexed")
        for _name, sql in triggers:
            c.execute(sql)
    # Written back into the database file, as a long-running install's history is (else
    # the first commits measured would copy the fill's write-ahead log back).
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def msg(chat: int, n: int, text: str) -> InboundMessage:
    return InboundMessage(id=f"bn:g{chat}:{n}", chat_jid=f"bn:g{chat}", sender="u",
                          sender_name="U", content=text, timestamp=stamp(EPOCH + 10**9 + n),
                          channel="bench")


def read_calls() -> int:
    """This process's read system calls so far (SQLite reads a page it does not hold in its
    cache with one); 0 where /proc/self/io is not readable."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("syscr"))
    except (OSError, StopIteration):
        return 0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure(chats: int, total: int, years: float, turns: int,
                  commands: int, stores: int = 600) -> dict[str, dict[str, object]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = load_config(write_config(tmp, chats))
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        t0 = time.perf_counter()
        fill(db, chats, total, years)
        setup = {"chats": chats, "messages": total, "sent_outbox_rows": total,
                 "fill_s": round(time.perf_counter() - t0, 1),
                 "db_mb": round(cfg.db_path.stat().st_size / 2**20, 1)}
        ch = Recorder()
        outbox = OutboxWorker(db, [ch])
        engine = FakeEngine(default=chat_agent(lambda text: "answer " + " ".join(
            w for w in text.replace("<", " ").replace(">", " ").split() if w.startswith("q-"))))
        runner = ContainerRunner(cfg, engine)
        orch = Orchestrator(cfg, db, runner=runner, channels=[ch], wake_outbox=outbox.wake)
        orch.engine_ready.set()
        watcher = IpcWatcher(cfg, db)
        committed: dict[str, float] = {}
        out: dict[str, dict[str, object]] = {}

        def on_commit(items: list) -> None:  # noqa: ANN001 - the engine's batch
            now = time.perf_counter()
            for it in items:
                committed.setdefault(getattr(it, "name", ""), now)
            outbox.wake()

        watcher.engine.on_commit = on_commit
        stop = asyncio.Event()
        # What storing costs the thread that stores (the event loop's): an inbound
        # message (store_message) and an agent's reply (an outbox row), each in its own
        # transaction, as the orchestrator and the IPC engine write them.
        store, reply = [], []
        for k in range(stores):
            g = k % chats
            m = StoredMessage(f"bn:g{g}:s{k}", f"bn:g{g}", "u", "U",
                              f"what about the weather on stored day {k}",
                              stamp(EPOCH + 10**9 - stores + k), False, False)
            t0 = time.thread_time_ns()
            store_message(db, m, channel="bench", is_group=True)
            t1 = time.thread_time_ns()
            with db.transaction() as c:
                enqueue(c, chat_jid=f"bn:g{g}", kind="text", text=f"sunny, stored {k}",
                        source_group=f"g{g}")
            store.append(t1 - t0)
            reply.append(time.thread_time_ns() - t1)
        if stores:
            out["store"] = {"message_us": statistics.median(store) / 1000,
                            "reply_us": statistics.median(reply) / 1000}
        with db.transaction() as c:  # as if delivered: they hold no chat's queue
            c.execute("UPDATE outbox SET status = 'sent' WHERE status = 'pending'")
        looks = []
        for _ in range(50):  # the daemon's status look (Daemon.status): on its event loop
            t0 = time.perf_counter()
            status_counts(db)
            channel_states(db, {"bench": True}, {"bench": "bn:"})
            looks.append(time.perf_counter() - t0)
        out["status"] = {"look_ms": statistics.median(looks) * 1000}
        await outbox.start()
        watching = asyncio.create_task(watcher.run(stop))
        try:
            for i in range(chats):  # open each chat's conversation
                await orch.on_inbound(msg(i, i, "q-open"))
                await ch.until("answer q-open", timeout=300)
                ch.sent.clear()
            n, wall = chats, []
            cpu0, reads0 = time.process_time(), read_calls()
            for t in range(turns):
                n += 1
                t1 = time.perf_counter()
                await orch.on_inbound(msg(t % chats, n, f"q-t{t}"))
                wall.append(await ch.until(f"answer q-t{t}") - t1)
            out["turn"] = {"cpu_ms": (time.process_time() - cpu0) / turns * 1000,
                           "reads": (read_calls() - reads0) / turns,
                           "wall_p50_ms": statistics.median(wall) * 1000,
                           "wall_p99_ms": pct(wall, 0.99) * 1000}
            wall, commit = [], []
            cpu0, reads0 = time.process_time(), read_calls()
            for k in range(commands):
                g = k % chats
                folder = cfg.data_dir / "ipc" / f"g{g}" / "messages"
                body = json.dumps({"type": "message", "chat_jid": f"bn:g{g}",
                                   "text": f"c-{k}"}).encode()
                tmpf = folder / f".{k}.tmp"
                tmpf.write_bytes(body)
                name = f"{time.time_ns()}-{k}.json"
                t1 = time.perf_counter()
                os.rename(tmpf, folder / name)
                wall.append(await ch.until(f"c-{k}") - t1)
                if name in committed:
                    commit.append(committed[name] - t1)
            out["command"] = {"cpu_ms": (time.process_time() - cpu0) / commands * 1000,
                              "reads": (read_calls() - reads0) / commands,
                              "wall_p50_ms": statistics.median(wall) * 1000,
                              "wall_p99_ms": pct(wall, 0.99) * 1000,
                              "commit_p50_ms": statistics.median(commit) * 1000
                              if commit else None,
                              "commit_p99_ms": pct(commit, 0.99) * 1000 if commit else None}
            for v in out.values():
                v.update(setup)
        finally:
            orch.accepting = False
            orch.close_conversations()
            await orch.queue.shutdown(grace=10)
            await runner.aclose()
            stop.set()
            await watching
            watcher.close()
            await outbox.stop()
            engine.shutdown()
            db.close()
        return out


def rounded(d: dict[str, object]) -> dict[str, object]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=20)
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--years", type=float, default=3.0)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--commands", type=int, default=600)
    ap.add_argument("--stores", type=int, default=600,
                    help="messages and replies stored straight through the state layer "
                    "(their CPU on the storing thread, medians)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="empty and filled, this many times, in alternate order (each a "
                    "fresh database); the ratio is of the medians")
    a = ap.parse_args()
    results: dict[str, list[dict[str, dict[str, object]]]] = {"empty": [], "history": []}
    for r in range(a.rounds):
        order = [("empty", 0), ("history", a.messages)]
        for label, total in order if r % 2 == 0 else order[::-1]:  # alternated
            got = asyncio.run(measure(a.chats, total, a.years, a.turns, a.commands,
                                      a.stores))
            results[label].append(got)
            for what, v in got.items():
                print(json.dumps({"figure": f"{what}_{label}", **rounded(v),
                                  "loadavg": round(os.getloadavg()[0], 1)}), flush=True)
    ratio: dict[str, object] = {}
    for what in ("turn", "command", "store", "status"):
        for key in ("cpu_ms", "wall_p50_ms", "commit_p50_ms", "reads", "message_us",
                    "reply_us", "look_ms"):
            e = [r.get(what, {}).get(key) for r in results["empty"]]
            h = [r.get(what, {}).get(key) for r in results["history"]]
            if None in e or None in h:
                continue
            if statistics.median(e):  # type: ignore[arg-type]
                ratio[f"{what}_{key}"] = round(
                    statistics.median(h) / statistics.median(e), 2)  # type: ignore[arg-type]
    print(json.dumps({"figure": "history_over_empty", **ratio, "target": 1.2}), flush=True)


if __name__ == "__main__":
    main()
