"""The daemon's CPU per turn and per command as its history grows (issue 27).

A real state.db gets `--history` rows of history in each of `--chats` chats: inbound messages
(whole seconds, several to a second, as Telegram and WhatsApp give them) and as many sent
outbox rows; then the daemon's parts run in one event loop as in the daemon: the real
Orchestrator, queue and ContainerRunner (over the fake engine of tests/chat_engine.py, whose
containers answer like the agent runner), the real IpcWatcher and OutboxWorker, and a channel
that records what it is asked to send.

Each chat's first message opens its conversation (its prompt is the newest messages of the
history; not measured). Then, one at a time, spread over the chats:

- `turn_cpu_ms`: a person's message handed to the orchestrator, fed into the chat's open
  conversation, answered, the answer delivered to the channel;
- `command_cpu_ms`: an agent's `message` command file renamed into ipc/<group>/messages/,
  applied, its outbox row delivered to the channel.

CPU is the process's (every thread: the event loop, its worker threads, the fake containers'
threads, which read a file and write a block per input), per turn / per command; the wall
time is the p50 from hand-over to the channel's send call. `fill_s` is the time to write the
history (its transcript triggers included).

Usage: python bench/history_cost.py [--chats 10] [--history 20000] [--turns 100]
[--commands 300]
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

from chat_engine import ChatEngine  # noqa: E402

from mdclaw.channels.base import Channel, InboundMessage  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.ipc.watcher import IpcWatcher  # noqa: E402
from mdclaw.orchestrator import Orchestrator  # noqa: E402
from mdclaw.outbox import OutboxWorker  # noqa: E402
from mdclaw.reconcile import reconcile  # noqa: E402
from mdclaw.runner import ContainerRunner  # noqa: E402
from mdclaw.state import Database  # noqa: E402


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


def second(k: int) -> str:
    """The `k`-th whole second from 2025-01-01, as the database stores times."""
    return (f"2025-01-{1 + k // 86400:02d}T{k // 3600 % 24:02d}:{k // 60 % 60:02d}:"
            f"{k % 60:02d}.000Z")


def fill(db: Database, chats: int, history: int) -> None:
    """`history` answered messages and sent outbox rows in each chat (columns every schema
    version has, so the same bench runs on an older tree)."""
    for i in range(chats):
        jid = f"bn:g{i}"
        with db.transaction() as c:
            c.execute("INSERT OR IGNORE INTO chats (jid, last_activity, channel) "
                      "VALUES (?, '2025-01-01T00:00:00.000Z', 'bench')", (jid,))
            c.executemany(
                "INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp) "
                "VALUES (?, ?, 'u', 'U', ?, ?)",
                [(f"{jid}:h{n}", jid, f"what about the weather on day {n}", second(n // 3))
                 for n in range(history)])
            c.executemany(
                "INSERT INTO outbox (chat_jid, kind, text, status, attempts, source_group, "
                "created_at, updated_at, sent_at) VALUES (?, 'text', ?, 'sent', 1, ?, "
                "'2025-01-01T00:00:00.000Z', '2025-01-01T00:00:00.000Z', "
                "'2025-01-01T00:00:00.000Z')",
                [(jid, f"sunny, {n}", f"g{i}") for n in range(history)])


def msg(chat: int, n: int, text: str) -> InboundMessage:
    return InboundMessage(id=f"bn:g{chat}:{n}", chat_jid=f"bn:g{chat}", sender="u",
                          sender_name="U", content=text,
                          # A second of its own, after the history: the same figures on a
                          # tree whose cursor is a timestamp (which loses a message of the
                          # second its cursor is at).
                          timestamp=second(100_000 + n), channel="bench")


def emit(figure: str, cpu: float, n: int, wall: list[float], **extra: object) -> None:
    print(json.dumps({"figure": figure, "n": n, "cpu_ms": round(cpu / n * 1000, 3),
                      "wall_p50_ms": round(statistics.median(wall) * 1000, 3),
                      "loadavg": round(os.getloadavg()[0], 1), **extra}), flush=True)


async def measure(chats: int, history: int, turns: int, commands: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = load_config(write_config(tmp, chats))
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        t0 = time.perf_counter()
        fill(db, chats, history)
        setup = {"chats": chats, "history_per_chat": history,
                 "fill_s": round(time.perf_counter() - t0, 1)}
        ch = Recorder()
        outbox = OutboxWorker(db, [ch])
        engine = ChatEngine(lambda text: "answer " + " ".join(
            w for w in text.replace("<", " ").replace(">", " ").split() if w.startswith("q-")))
        runner = ContainerRunner(cfg, engine)
        orch = Orchestrator(cfg, db, runner=runner, channels=[ch], wake_outbox=outbox.wake)
        orch.engine_ready.set()
        watcher = IpcWatcher(cfg, db)
        watcher.engine.on_commit = lambda items: outbox.wake()
        stop = asyncio.Event()
        await outbox.start()
        watching = asyncio.create_task(watcher.run(stop))
        try:
            for i in range(chats):  # open each chat's conversation
                await orch.on_inbound(msg(i, 0, "q-open"))
                await ch.until("answer q-open", timeout=120)
                ch.sent.clear()
            n, wall = 0, []
            cpu0 = time.process_time()
            for t in range(turns):
                n += 1
                t1 = time.perf_counter()
                await orch.on_inbound(msg(t % chats, n, f"q-t{t}"))
                wall.append(await ch.until(f"answer q-t{t}") - t1)
            emit("turn_cpu_ms", time.process_time() - cpu0, turns, wall, **setup)

            wall = []
            cpu0 = time.process_time()
            for k in range(commands):
                g = k % chats
                folder = cfg.data_dir / "ipc" / f"g{g}" / "messages"
                body = json.dumps({"type": "message", "chat_jid": f"bn:g{g}",
                                   "text": f"c-{k}"}).encode()
                tmpf = folder / f".{k}.tmp"
                tmpf.write_bytes(body)
                t1 = time.perf_counter()
                os.rename(tmpf, folder / f"{time.time_ns()}-{k}.json")
                wall.append(await ch.until(f"c-{k}") - t1)
            emit("command_cpu_ms", time.process_time() - cpu0, commands, wall, **setup)
        finally:
            orch.accepting = False
            orch.close_conversations()
            await orch.queue.shutdown(grace=10)
            await runner.aclose()
            stop.set()
            await watching
            watcher.close()
            await outbox.stop()
            db.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=10)
    ap.add_argument("--history", type=int, default=20_000)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--commands", type=int, default=300)
    a = ap.parse_args()
    asyncio.run(measure(a.chats, a.history, a.turns, a.commands))


if __name__ == "__main__":
    main()
