"""Outbound and inbound latency through the outbox worker and the local HTTP channel.

Figures (one JSON object per line):
- `outbox_enqueue_to_send_ms`: a row committed to the outbox and `wake()` called, until the
  channel's `send_message` is entered (a recording channel; real worker, real state.db).
- `http_reply_visible_ms`: the same, with the real local HTTP channel, until a client blocked
  in `GET /messages?wait=` receives the reply.
- `http_post_to_inbound_ms`: `POST /message` sent until the host's inbound callback runs.

Usage: python bench/outbox_delivery.py [--rounds 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdclaw.channels.base import Channel, InboundMessage  # noqa: E402
from mdclaw.channels.http import HttpChannel  # noqa: E402
from mdclaw.outbox import OutboxWorker  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.groups import GroupRow, upsert_group  # noqa: E402
from mdclaw.state.outbox import enqueue  # noqa: E402


class Recording(Channel):
    name = "bench"
    jid_prefix = "bn:"

    def __init__(self) -> None:
        super().__init__()
        self.entered: asyncio.Future[float] | None = None

    async def connect(self) -> None: ...
    async def disconnect(self) -> None: ...

    def is_connected(self) -> bool:
        return True

    async def send_message(self, jid, text, *, reply_to=None, sender=None):
        if self.entered is not None and not self.entered.done():
            self.entered.set_result(time.perf_counter())
        return None

    async def send_file(self, *a, **kw): return None
    async def react(self, *a, **kw): return None
    async def set_typing(self, *a, **kw): return None


def figure(name: str, samples: list[float]) -> None:
    s = sorted(samples)
    print(json.dumps({"figure": name, "n": len(s), "p50_ms": round(statistics.median(s), 3),
                      "p95_ms": round(s[int(len(s) * 0.95) - 1], 3),
                      "max_ms": round(s[-1], 3)}))


def put(db: Database, jid: str, text: str) -> None:
    with db.transaction() as c:
        enqueue(c, chat_jid=jid, kind="text", text=text, source_group="main")


async def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        db = Database(Path(tmp) / "state.db")
        upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
        rec = Recording()
        inbound: asyncio.Future[float] | None = None

        def on_inbound(msg: InboundMessage) -> None:
            if inbound is not None and not inbound.done():
                inbound.set_result(time.perf_counter())

        http = HttpChannel(db, listen="127.0.0.1:0", on_inbound=on_inbound)
        await http.connect()
        worker = OutboxWorker(db, [rec, http], max_idle=60)
        await worker.start()
        loop = asyncio.get_running_loop()
        try:
            samples = []
            for i in range(rounds):
                rec.entered = loop.create_future()
                t0 = time.perf_counter()
                put(db, "bn:1", f"m{i}")
                worker.wake()
                samples.append((await rec.entered - t0) * 1000)
            figure("outbox_enqueue_to_send_ms", samples)

            samples = []
            async with aiohttp.ClientSession(http.url) as client:
                cursor = 0
                for i in range(rounds):
                    async def reader(after: int) -> tuple[float, int]:
                        async with client.get("/messages", params={
                                "jid": "hl:main", "after": after, "wait": "10"}) as r:
                            data = await r.json()
                        assert data["messages"], "no reply within 10 s"
                        return time.perf_counter(), data["cursor"]

                    task = asyncio.create_task(reader(cursor))
                    await asyncio.sleep(0.005)  # the client is waiting in its long poll
                    t0 = time.perf_counter()
                    put(db, "hl:main", f"r{i}")
                    worker.wake()
                    seen, cursor = await task
                    samples.append((seen - t0) * 1000)
                figure("http_reply_visible_ms", samples)

                samples = []
                for i in range(rounds):
                    inbound = loop.create_future()
                    t0 = time.perf_counter()
                    async with client.post("/message", json={"text": f"in {i}"}) as r:
                        assert r.status == 202
                    samples.append((await inbound - t0) * 1000)
                figure("http_post_to_inbound_ms", samples)
        finally:
            await worker.stop()
            await http.disconnect()
            db.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    asyncio.run(main(ap.parse_args().rounds))
