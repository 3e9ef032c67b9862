"""memory_search over past conversations: search latency with 100,000 stored messages.

A real state.db (WAL) with `--groups` registered groups and `--messages` rows of chat text,
60% inbound messages (`messages`) and 40% replies (`outbox`), written through the tables'
triggers so the transcript index is built as the daemon builds it. Text is drawn from a
Zipf-distributed vocabulary (a few hundred everyday English words that dominate, as in real
chat, and 20,000 rarer words), 4 to 40 words a message.

Figures:
- search latency (`mdclaw.state.transcripts.search`, top 5, one group, snippets and bm25)
  for a word said in that group (drawn from its stored messages), a rare word (often not
  in that group), a common word, a natural question of seven words, and a hostile query;
- the cost of the transcript at write time: store_message (one transaction) with its
  transcript row (from migration 17 the row's id is queued and the full-text index follows
  in batches: the first search indexes the fill), and with the transcript trigger dropped, on
  the same database;
- migration 10's backfill of the same rows written before the index existed; database size.

Usage: python bench/memory_search.py [--messages 100000] [--groups 50] [--rounds 500]
Prints one JSON object per figure.
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mdclaw.state import Database  # noqa: E402
from mdclaw.state.conversations import StoredMessage, store_message  # noqa: E402
from mdclaw.state.db import _split_sql  # noqa: E402
from mdclaw.state.migrations import MIGRATIONS  # noqa: E402
from mdclaw.state.transcripts import search  # noqa: E402

COMMON = """the be to of and a in that have i it for not on with he as you do at this but his by
from they we say her she or an will my one all would there their what so up out if about who
get which go me when make can like time no just him know take people into year your good some
could them see other than then now look only come its over think also back after use two how
our work first well way even new want because any these give day most us is are was were been
has had did does yes ok okay thanks please sure tomorrow today tonight morning evening week
weekend dinner lunch breakfast kids school home car train bus shop buy need remember remind
call meeting doctor appointment birthday party weather rain sunny cold warm hot garden water
plants dog cat walk park movie book read music play game football match score news check send
photo picture video link email message phone later soon maybe yeah sorry great nice love haha
lol fine here where why which whose let put keep tell ask pay cost price euro money bill rent
house room kitchen bed clean wash cook food milk bread coffee tea beer wine cake pizza""".split()


def vocabulary(rng: random.Random, rare: int = 20_000) -> tuple[list[str], list[float]]:
    syll = ["ka", "lo", "mi", "ren", "sto", "vel", "dar", "qui", "bex", "tor", "an", "el",
            "sur", "fin", "gal", "hop", "jun", "mar", "nex", "pol", "ris", "tam", "ul", "zen"]
    words = list(COMMON)
    seen = set(words)
    while len(words) < len(COMMON) + rare:
        w = "".join(rng.choice(syll) for _ in range(rng.randint(2, 4)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    weights = [1.0 / (rank + 1) ** 1.07 for rank in range(len(words))]
    return words, weights


def sentences(rng: random.Random, words: list[str], weights: list[float], n: int) -> list[str]:
    flat = rng.choices(words, weights, k=n * 22)
    out, i = [], 0
    for _ in range(n):
        k = rng.randint(4, 40)
        s = " ".join(flat[i:i + k])
        i = (i + k) % (len(flat) - 41)
        out.append(s[0].upper() + s[1:] + rng.choice((".", "?", "!", "")))
    return out


def fill(conn: sqlite3.Connection, n: int, groups: int, rng: random.Random,
         texts: list[str]) -> None:
    """Rows of `groups` groups in their chats: 60% inbound, 40% replies (one transaction)."""
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO registered_groups (folder, name, jid, trigger, added_at)"
                     " VALUES (?, ?, ?, '@Andy', '2025-01-01T00:00:00.000Z')",
                     [(f"group{g:03d}", f"G{g}", f"tg:{g}") for g in range(groups)])
    conn.executemany("INSERT INTO chats (jid, last_activity) VALUES (?, 'x')",
                     [(f"tg:{g}",) for g in range(groups)])
    msgs, out = [], []
    for i in range(n):
        g = rng.randrange(groups)
        ts = f"2025-{1 + i * 12 // n:02d}-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:00.000Z"
        if rng.random() < 0.6:
            msgs.append((f"tg:{g}:{i}", f"tg:{g}", f"u{i % 7}", rng.choice(
                ("Alice", "Bob", "Chris", "Dana")), texts[i], ts))
        else:
            out.append((f"tg:{g}", texts[i], f"group{g:03d}", ts, ts))
    conn.executemany("INSERT INTO messages (id, chat_jid, sender, sender_name, content,"
                     " timestamp) VALUES (?, ?, ?, ?, ?, ?)", msgs)
    conn.executemany("INSERT INTO outbox (chat_jid, kind, text, source_group, status,"
                     " created_at, updated_at) VALUES (?, 'text', ?, ?, 'sent', ?, ?)", out)
    conn.execute("COMMIT")


def timed(fn, rounds: int) -> list[float]:
    out = []
    for i in range(rounds):
        t0 = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t0) * 1000)
    return sorted(out)


def pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, max(0, round(len(xs) * p) - 1))]


def report(figure: str, ms: list[float], **extra) -> None:
    print(json.dumps({"bench": "memory_search", "figure": figure, "rounds": len(ms),
                      "p50_ms": round(statistics.median(ms), 3), "p95_ms": round(pct(ms, .95), 3),
                      "p99_ms": round(pct(ms, .99), 3), "max_ms": round(ms[-1], 3), **extra}),
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=500)
    args = ap.parse_args()
    rng = random.Random(12)
    words, weights = vocabulary(rng)
    texts = sentences(rng, words, weights, args.messages)

    with tempfile.TemporaryDirectory() as tmp:
        # The same rows written before migration 10, then the upgrade (its backfill).
        old = Path(tmp) / "old.db"
        conn = sqlite3.connect(old, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        before = [m for m in MIGRATIONS if m[0] < 10]
        for v, _d, script in before:
            for statement in _split_sql(script):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={v}")
        fill(conn, args.messages, args.groups, random.Random(5), texts)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        size_before = old.stat().st_size
        t0 = time.perf_counter()
        db = Database(old)
        backfill_ms = (time.perf_counter() - t0) * 1000
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        rows = db.scalar("SELECT COUNT(*) FROM transcript")
        print(json.dumps({"bench": "memory_search", "figure": "migration_10_backfill",
                          "rows": rows, "ms": round(backfill_ms),
                          "db_mb_before": round(size_before / 2**20, 1),
                          "db_mb_after": round(old.stat().st_size / 2**20, 1)}), flush=True)
        db.close()

        # A database whose index was built row by row by the triggers, as the daemon does.
        path = Path(tmp) / "state.db"
        db = Database(path)
        t0 = time.perf_counter()
        fill(db.conn, args.messages, args.groups, random.Random(5), texts)
        fill_s = time.perf_counter() - t0
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        n = db.scalar("SELECT COUNT(*) FROM transcript")
        print(json.dumps({"bench": "memory_search", "figure": "corpus", "rows": n,
                          "groups": args.groups, "fill_s": round(fill_s, 1),
                          "db_mb": round(path.stat().st_size / 2**20, 1)}), flush=True)

        folders = [f"group{g:03d}" for g in range(args.groups)]
        rare = [w for w in words[len(COMMON) + 500:len(COMMON) + 3000]]
        # Words that were said in the searched group: a random word of a random message.
        said = []
        for i in range(args.rounds):
            folder = folders[i % len(folders)]
            body = db.query_one("SELECT body FROM transcript WHERE group_folder = ? "
                                "ORDER BY random() LIMIT 1", (folder,))
            said.append(rng.choice(body[0].rstrip(".?!").split()) if body else "kayak")
        queries = {
            "word_said_in_the_group": lambda i: said[i % len(said)],
            "rare_word": lambda i: rare[i % len(rare)],
            "common_word": lambda i: COMMON[40 + i % 100],
            "question_7_words": lambda i: (f"what did {COMMON[i % 60]} say about the "
                                           f"{rare[i % len(rare)]} {words[200 + i % 800]}"),
            "hostile": lambda i: f'NEAR("{rare[i % len(rare)]}" -* (OR {COMMON[i % 60]}',
        }
        for name, q in queries.items():
            hits: list[int] = []

            def one(i: int, q=q, hits=hits) -> None:
                hits.append(len(search(db.conn, folders[i % len(folders)], q(i), 5)))

            one(0)
            hits.clear()
            ms = timed(one, args.rounds)
            report(f"search_{name}", ms, rows=n, top_k=5,
                   mean_hits=round(sum(hits) / len(hits), 2), example=q(1))

        # The index's cost at write time: store_message with it, then without its triggers.
        def store(i: int, tag: str) -> None:
            g = i % args.groups
            store_message(db, StoredMessage(f"bench-{tag}-{i}", f"tg:{g}", "u1", "Alice",
                                            texts[i], "2026-01-01T00:00:00.000Z", False, False))

        report("store_message_with_index", timed(lambda i: store(i, "a"), args.rounds))
        db.conn.execute("DROP TRIGGER transcript_messages_ai")
        report("store_message_without_index", timed(lambda i: store(i, "b"), args.rounds),
               note="contrast: the same call with the index trigger dropped")
        db.close()


if __name__ == "__main__":
    main()
