"""CPU of the local HTTP channel's `send_message` into a chat that holds its transcript's
limit (`keep_per_chat` rows), the embedded default's delivery of every reply (a person's
message goes through the same write).

The channel is the real one on a real state.db, its web server on a loopback port (no
page open: nothing waits on the transcript). The chat is first filled to `--keep`
rows; then `--messages` replies are sent back to back (`warm`), and `--paced` more at
`--rate` a second (`paced`: each on cold caches, as a household's replies come). Figures:
thread CPU per message, in µs. `--tree` runs another checkout's mdclaw (a before/after in
one session: run it once with each tree).

    python bench/http_transcript.py [--keep 1000] [--messages 2000] [--paced 200]
                                    [--rate 20] [--tree /tmp/other-checkout]
"""

from __future__ import annotations

import argparse
import asyncio
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
        t0 = time.thread_time_ns()
        for i in range(args.messages):
            await ch.send_message("hl:main", f"reply {i} " + "words " * 20)
        warm = (time.thread_time_ns() - t0) / args.messages / 1000
        cpu = 0
        start = time.monotonic()
        for i in range(args.paced):
            wait = start + i / args.rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            t = time.thread_time_ns()
            await ch.send_message("hl:main", f"paced {i} " + "words " * 20)
            cpu += time.thread_time_ns() - t
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
    ap.add_argument("--tree", default=str(REPO), help="the checkout whose mdclaw runs")
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    out = asyncio.run(run(args))
    import mdclaw
    print(json.dumps({"bench": "http_transcript", "mdclaw": str(Path(mdclaw.__file__).parent),
                      "keep": args.keep, **out}))


if __name__ == "__main__":
    main()
