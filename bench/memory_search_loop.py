"""IPC commit latency of other groups while memory_search of very common words runs.

The real IPC loop (with its action worker) runs in a child process over a real state.db
holding `--messages` transcript rows (bench/memory_search.py's Zipf text) spread over 5
searching groups g001..g005. Phase "idle": pause/resume commands of groups g011.. are timed
from rename to COMMIT, nothing else running. Phase "loaded": each searching group keeps one
`memory_search {query: "the be to of and a", sources: sessions, topK: 5}` outstanding (a new
one as soon as its result lands) while the same commands are timed.

    python bench/memory_search_loop.py [--messages 100000] [--samples 300] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import tempfile
import time
from pathlib import Path

from ipc_common import PauseResume, emit, make_data_dir, one_task_per_group, p50_p99, serve, stage
from memory_search import sentences, vocabulary

SEARCHERS = [f"g{i:03d}" for i in range(1, 6)]
QUERY = "the be to of and a"


def fill(db_path: Path, n: int, rng: random.Random) -> None:
    """`n` rows in the searching groups' chats, 60% inbound, 40% replies, as the daemon
    stores them (the transcript triggers index them)."""
    words, weights = vocabulary(rng)
    texts = sentences(rng, words, weights, n)
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("BEGIN")
    msgs, out = [], []
    for i in range(n):
        g = 1 + rng.randrange(len(SEARCHERS))
        ts = f"2025-{1 + i * 12 // n:02d}-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.000Z"
        if rng.random() < 0.6:
            msgs.append((f"tg:{g}:{i}", f"tg:{g}", f"u{i % 7}", "Alice", texts[i], ts))
        else:
            out.append((f"tg:{g}", texts[i], f"g{g:03d}", ts, ts))
    conn.executemany("INSERT OR IGNORE INTO chats (jid, last_activity) VALUES (?, 'x')",
                     [(f"tg:{g}",) for g in range(1, 6)])
    conn.executemany("INSERT INTO messages (id, chat_jid, sender, sender_name, content,"
                     " timestamp) VALUES (?, ?, ?, ?, ?, ?)", msgs)
    conn.executemany("INSERT INTO outbox (chat_jid, kind, text, source_group, status,"
                     " created_at, updated_at) VALUES (?, 'text', ?, ?, 'sent', ?, ?)", out)
    conn.execute("COMMIT")
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between commands")
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        fill(root / "data" / "state.db", args.messages, rng)
        ipc = root / "data" / "ipc"
        groups = [f"g{i:03d}" for i in range(11, args.groups)]
        one_task_per_group(ipc, groups)
        server = serve(cfg)
        searches: dict[tuple[str, str], tuple[int, int | None]] = {}
        seq = 0
        try:
            timed = PauseResume(ipc, groups, rng, args.gap)
            outstanding: dict[str, str] = {}

            def search_more() -> None:
                """Give each searching group a new search once its last one answered."""
                nonlocal seq
                for g in SEARCHERS:
                    rid = outstanding.get(g)
                    if rid is not None:
                        if not (ipc / g / "action_results" / f"{rid}.json").exists():
                            continue
                        start, _ = searches[(g, rid)]
                        searches[(g, rid)] = (start, time.monotonic_ns())
                    seq += 1
                    rid = f"s{seq}"
                    d = ipc / g / "actions"
                    d.mkdir(exist_ok=True)
                    searches[(g, rid)] = (time.monotonic_ns(), None)
                    stage(d / f"{rid}.json", {
                        "type": "action", "requestId": rid, "action": "memory_search",
                        "params": {"query": QUERY, "sources": "sessions", "topK": 5}}
                    ).rename(d / f"{rid}.json")
                    outstanding[g] = rid

            for _ in range(args.samples):
                timed.sample("idle")
            for _ in range(args.samples):
                search_more()
                timed.sample("loaded")
            deadline = time.monotonic() + 60
            while any(not (ipc / g / "action_results" / f"{r}.json").exists()
                      for g, r in outstanding.items()):
                if time.monotonic() > deadline:
                    raise SystemExit("search results missing")
                time.sleep(0.01)
            ok = sum(json.loads((ipc / g / "action_results" / f"{r}.json").read_text())
                     ["status"] == "success" for g, r in searches)
        finally:
            commits = server.stop()
    by_phase = timed.commit_ms(commits)
    answered = [(end - start) / 1e6 for start, end in searches.values() if end is not None]
    idle50, idle99 = p50_p99(by_phase["idle"])
    load50, load99 = p50_p99(by_phase["loaded"])
    s50, s99 = p50_p99(answered)
    common = {"samples": args.samples, "messages": args.messages, "query": QUERY,
              "searches": len(searches), "searches_ok": ok}
    emit("memory_search_loop_commit_idle_p50", idle50, "ms", **common)
    emit("memory_search_loop_commit_idle_p99", idle99, "ms", **common)
    emit("memory_search_loop_commit_loaded_p50", load50, "ms", **common)
    emit("memory_search_loop_commit_loaded_p99", load99, "ms", **common)
    emit("memory_search_loop_p99_ratio", load99 / idle99, "x", **common)
    emit("memory_search_request_to_result_p50", s50, "ms", **common)
    emit("memory_search_request_to_result_p99", s99, "ms", **common)


if __name__ == "__main__":
    main()
