"""CPU of the local HTTP channel's `send_message` into a chat that holds its transcript's
limit (`keep_per_chat` rows), the embedded default's delivery of every reply (a person's
message goes through the same write).

The channel is the real one on a real state.db, its web server on a loopback port (no
page open: nothing waits on the transcript). The chat is first filled to `--keep`
rows; then `--messages` replies are sent back to back (`warm`), and `--paced` more at
`--rate` a second (`paced`: each on cold caches, as a household's replies come). Figures:
thread CPU per message, in µs. `--tree` runs another checkout's mdclaw (a before/after in
one session: run it once with each tree).

`--through-outbox`: each reply goes the daemon's way instead, through the real outbox
worker: its row written already claimed (the IPC engine's transaction for a message),
handed to the worker, and delivered to the channel, its `sent` mark written; the figure
is the loop thread's CPU per reply from the row's transaction to the worker's `on_sent`,
the loop's turns included.

    python bench/http_transcript.py [--keep 1000] [--messages 2000] [--paced 200]
                                    [--rate 20] [--through-outbox] [--tree /tmp/checkout]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def run(args: argparse.Namespace) -> dict[str, float]:
    from mdclaw.channels.http import HttpChannel
    from mdclaw.state import Database
    from mdclaw.state.groups import GroupRow, upsert_group
    from mdclaw.webserver import TokenGate, WebServer

    with tempfile.TemporaryDirectory() as tmp:
        db = Database(Path(tmp) / "state.db")
        upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
        ch = HttpChannel(db, WebServer("127.0.0.1:0", TokenGate(None)),
                         keep_per_chat=args.keep)
        await ch.server.start()
        await ch.connect()
        for i in range(args.keep):
            await ch.send_message("hl:main", f"history {i}")
        send = ch.send_message
        worker = None
        if args.through_outbox:
            from mdclaw.outbox import OutboxWorker, get_row
            from mdclaw.state.outbox import enqueue
            sent = asyncio.Event()
            worker = OutboxWorker(db, [ch], on_sent=lambda row: sent.set())
            await worker.start()

            async def through_outbox(jid: str, text: str) -> None:
                sent.clear()
                with db.transaction() as c:
                    rid = enqueue(c, chat_jid=jid, kind="text", text=text,
                                  source_group="main", claimed=True)
                row = get_row(db, rid)
                assert row is not None and worker.accepts(jid)
                # As the engine hands it: as it was before its claim.
                worker.hand_off([dataclasses.replace(row, status="pending",
                                                     attempts=row.attempts - 1)])
                await sent.wait()
            send = through_outbox  # type: ignore[assignment]
        t0 = time.thread_time_ns()
        for i in range(args.messages):
            await send("hl:main", f"reply {i} " + "words " * 20)
        warm = (time.thread_time_ns() - t0) / args.messages / 1000
        cpu = 0
        start = time.monotonic()
        for i in range(args.paced):
            wait = start + i / args.rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            t = time.thread_time_ns()
            await send("hl:main", f"paced {i} " + "words " * 20)
            await asyncio.sleep(0)  # the worker's step after on_sent, if any
            cpu += time.thread_time_ns() - t
        if worker is not None:
            await worker.stop()
        rows = db.scalar("SELECT count(*) FROM http_messages WHERE chat_jid = 'hl:main'")
        await ch.disconnect()
        await ch.server.stop()
        db.close()
    assert rows == args.keep, rows  # the transcript still holds exactly its limit
    return {"warm_cpu_us": round(warm, 1),
            "paced_cpu_us": round(cpu / max(1, args.paced) / 1000, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", type=int, default=1000)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--paced", type=int, default=200)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--through-outbox", action="store_true",
                    help="each reply through the real outbox worker (see above)")
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose mdclaw runs")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    out = asyncio.run(run(args))
    import mdclaw
    print(json.dumps({"bench": "http_transcript", "mdclaw": str(Path(mdclaw.__file__).parent),
                      "keep": args.keep,
                      "through_outbox": args.through_outbox, **out}))


if __name__ == "__main__":
    main()
