"""Full-text search over every group's conversation transcript.

The `transcript` table (migration 10) holds one row per thing said in a group's
conversation: inbound messages (kind `message`, direction `in`), what the host sent to the
chat (kind `reply`, direction `out`) and the output of scheduled task runs (kind `task`).
Triggers on `messages` and `task_run_logs` write it in the transaction that stores the
source row. A reply's row is written later (migration 21): storing an outbox text or file
only queues its id in `transcript_replies_queued` (a command's transaction is then about
30 us shorter), and the indexer writes the rows of queued replies from the view
`transcript_queued_reply_rows`, the one definition of a reply's row; a task run that
succeeds writes the queued ones first, in its own transaction, so that it can relabel them.

The FTS5 index `transcript_fts` is written in batches, not in the storing transaction
(migration 17): a new transcript row only queues its id in `transcript_unindexed`.
`index_queued` is one batch, one transaction: it writes the rows of queued replies and
moves queued rows into the index (the rows, the index's rows and the queues' deletions
commit together, so after a crash every reply is queued or has its row, every row is queued
or indexed, exactly one of the two each). The daemon's background thread of the IPC watcher
runs `flush_index` about once a second and at start (mdclaw/ipc/writers.py); `search` first
works off both queues, in its own transaction, so whatever was stored before a search is
found. A reader that may not write (a read-only export) reads the queued replies' rows from
the view. Triggers on `transcript` keep the index in step with deletions and changes: a
queued row deleted only leaves the queue (the index's 'delete' of a row it does not hold
corrupts it), a queued row changed needs nothing (it is indexed as it is when its batch
comes); a reply deleted leaves the reply queue or has its row deleted.

The index uses `porter unicode61 remove_diacritics 2`: words are folded to lower case
without accents (so `cafe` finds `café`), then reduced to their English stem, so an agent
that asks for `deploy` also finds `deployed` and `deploying`. Stemming only widens what
matches; bm25 still ranks the closest wording first, and words of other languages are at
worst stemmed as if English (a few extra, lower-ranked hits).

A search is confined to one group inside the index: every row carries its folder as one
extra token (column `grp`, weighted 0 in bm25), so the engine intersects the group's rows
with the words' rows before ranking anything.

User text never reaches the FTS5 query language: the query is cut at white space and marks
(brackets, quotes, `*`, `^`, `+`...) and each piece that has a letter or digit becomes a
quoted string (`"` doubled), so `NEAR`, `AND`, `*`, `-`, `:` and parentheses are plain
text. Pieces are joined with OR and ranked by bm25,
so rows with more (and rarer) words come first.
"""

from __future__ import annotations

import re
import sqlite3
import time
from dataclasses import asdict, dataclass
from typing import Any

# Queued rows moved into the index per transaction, at most: a few ms of the write lock
# (about 5 us a row in a batch, where each row's own transaction cost over 100 us).
INDEX_BATCH = 500
MAX_TERMS = 32  # pieces of a query used (the rest is ignored)
MAX_TERM_CHARS = 100  # a longer piece is cut
SNIPPET_TOKENS = 24  # words around the match in a snippet
MARK_OPEN, MARK_CLOSE = "**", "**"  # around each matched word in a snippet
ELLIPSIS = "…"
# Where a query is cut into pieces: white space and any mark but the few that join the parts
# of one word or name (e-mail, don't, example.com, 10:30, a/b); a piece with those inside is
# searched as a phrase of its parts.
_CUT = re.compile(r"[^\w\-'’.@:/]+|_+")


@dataclass(frozen=True)
class TranscriptHit:
    """One ranked match: where it was said, by whom, when, and the words around the match."""

    id: int
    kind: str  # message | reply | task
    direction: str  # in | out
    group: str
    chat: str | None
    sender: str | None
    task_id: str | None
    timestamp: str
    snippet: str
    score: float  # -bm25: higher is better

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["task_id"] is None:
            del d["task_id"]
        return d


def group_token(folder: str) -> str:
    """The one index token that stands for `folder` (the `grp` column's value)."""
    return "g" + folder.encode("utf-8").hex() + "0"


def _quote(piece: str) -> str:
    return '"' + piece.replace('"', '""') + '"'


def query_terms(query: str) -> list[str]:
    """The pieces of `query` that are searched for: cut at white space and marks, those with
    a letter or digit, each cut to MAX_TERM_CHARS, without repeats, at most MAX_TERMS."""
    out: list[str] = []
    seen: set[str] = set()
    for piece in _CUT.split(query):
        if not any(ch.isalnum() for ch in piece):
            continue
        piece = piece[:MAX_TERM_CHARS]
        key = piece.casefold()
        if key in seen:
            continue
        seen.add(key)
        out.append(piece)
        if len(out) == MAX_TERMS:
            break
    return out


def match_expression(folder: str, query: str) -> str | None:
    """The FTS5 MATCH expression for `query` within `folder`'s rows; None when the query has
    nothing to search for."""
    terms = query_terms(query)
    if not terms:
        return None
    words = " OR ".join(_quote(t) for t in terms)
    return f"grp : {_quote(group_token(folder))} AND body : ({words})"


# --------------------------------------------------------------------------- the index queue

def has_queued(conn: sqlite3.Connection) -> bool:
    """Whether any reply waits for its transcript row or any transcript row waits to be
    indexed (a seek of each of two small tables)."""
    return conn.execute("SELECT EXISTS (SELECT 1 FROM transcript_replies_queued) "
                        "OR EXISTS (SELECT 1 FROM transcript_unindexed)").fetchone()[0] == 1


def write_queued_replies(conn: sqlite3.Connection, limit: int = INDEX_BATCH) -> int:
    """Write the transcript rows of the `limit` lowest queued replies (their rows then wait
    to be indexed) and take them out of the queue; return how many left it. Call inside a
    write transaction: both statements commit together."""
    hi = conn.execute("SELECT max(id) FROM (SELECT id FROM transcript_replies_queued "
                      "ORDER BY id LIMIT ?)", (limit,)).fetchone()[0]
    if hi is None:
        return 0
    conn.execute("INSERT OR IGNORE INTO transcript (source, source_id, kind, direction, "
                 "group_folder, chat_jid, sender, ts, body) "
                 "SELECT 'outbox', CAST(id AS TEXT), 'reply', 'out', group_folder, chat_jid, "
                 "sender, ts, body FROM transcript_queued_reply_rows WHERE id <= ? "
                 "ORDER BY id", (hi,))
    return conn.execute("DELETE FROM transcript_replies_queued WHERE id <= ?",
                        (hi,)).rowcount


def index_queued(conn: sqlite3.Connection, limit: int = INDEX_BATCH) -> int:
    """One batch: write the rows of the `limit` lowest queued replies, then move the `limit`
    lowest queued rows into the full-text index and out of the queue; return how many rows
    it took out of the two queues (less than `limit`: both are empty now). Call inside a
    write transaction: every statement commits together."""
    written = write_queued_replies(conn, limit)
    hi = conn.execute("SELECT max(id) FROM (SELECT id FROM transcript_unindexed "
                      "ORDER BY id LIMIT ?)", (limit,)).fetchone()[0]
    if hi is None:
        return written
    conn.execute("INSERT INTO transcript_fts (rowid, body, grp) "
                 "SELECT t.id, t.body, t.grp FROM transcript_unindexed q "
                 "JOIN transcript t ON t.id = q.id WHERE q.id <= ? ORDER BY q.id", (hi,))
    return written + conn.execute("DELETE FROM transcript_unindexed WHERE id <= ?",
                                  (hi,)).rowcount


def _readonly(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_READONLY


def flush_index(conn: sqlite3.Connection, batch: int = INDEX_BATCH, *,
                yielding: bool = False) -> int:
    """Write every queued reply's row and index every queued row, `batch` of each per
    transaction of its own (in the caller's transaction instead when `conn` is in one);
    return how many rows it took out of the two queues. Cheap when nothing is
    queued. A connection that may not write indexes nothing (0). `yielding`: between two
    batches, wait as long as the last one took, so other writers (the event loop's
    commits) get the write lock in between while a long queue is worked off."""
    if not has_queued(conn):
        return 0
    if conn.in_transaction:
        done = 0
        while n := index_queued(conn, batch):
            done += n
            if n < batch or not has_queued(conn):
                break
        return done
    done = 0
    while True:
        started = time.monotonic()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            if _readonly(e):
                return done
            raise
        try:
            n = index_queued(conn, batch)
        except sqlite3.Error as e:
            conn.execute("ROLLBACK")
            if _readonly(e):
                return done
            raise
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        done += n
        # Fewer than a batch: both queues are empty. A full one (replies written and rows
        # indexed count together) may have emptied them as well: no empty transaction then.
        if n < batch or not has_queued(conn):
            return done
        if yielding:
            time.sleep(max(0.001, time.monotonic() - started))


def rebuild_index(conn: sqlite3.Connection) -> None:
    """Build the index again from every transcript row (FTS5's 'rebuild'), and empty the
    queue in the same transaction: every row is then indexed."""
    conn.execute("INSERT INTO transcript_fts (transcript_fts) VALUES ('rebuild')")
    conn.execute("DELETE FROM transcript_unindexed")


# --------------------------------------------------------------------------- search

def search(conn: sqlite3.Connection, folder: str, query: str,
           limit: int) -> list[TranscriptHit]:
    """The `limit` best matches of `query` in `folder`'s transcript, best first (bm25; the
    newer first among equals). Snippets mark the matched words with MARK_OPEN/MARK_CLOSE.

    Rows still queued for the index are indexed first (through `conn`, in a transaction of
    their own unless `conn` is in one), so a row stored before the search is found. A
    read-only connection cannot do that: it finds what the indexer indexed so far."""
    expr = match_expression(folder, query)
    if expr is None or limit <= 0:
        return []
    flush_index(conn)
    rows = conn.execute(
        """SELECT t.id, t.kind, t.direction, t.group_folder, t.chat_jid, t.sender, t.task_id,
                  t.ts, snippet(transcript_fts, 0, ?, ?, ?, ?) AS snip,
                  bm25(transcript_fts, 1.0, 0.0) AS rank
           FROM transcript_fts JOIN transcript t ON t.id = transcript_fts.rowid
           WHERE transcript_fts MATCH ?
           ORDER BY rank, t.ts DESC, t.id DESC LIMIT ?""",
        (MARK_OPEN, MARK_CLOSE, ELLIPSIS, SNIPPET_TOKENS, expr, limit),
    ).fetchall()
    return [TranscriptHit(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8] or "",
                          round(-float(r[9]), 6)) for r in rows]
