"""Full-text search over every group's conversation transcript.

The `transcript` table (migration 10) holds one row per thing said in a group's
conversation: inbound messages (kind `message`, direction `in`), what the host sent to the
chat (kind `reply`, direction `out`) and the output of scheduled task runs (kind `task`).
Triggers on `messages`, `outbox` and `task_run_logs` write it in the transaction that stores
the source row; triggers on `transcript` keep the FTS5 index `transcript_fts` in step.

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
from dataclasses import asdict, dataclass
from typing import Any

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


def search(conn: sqlite3.Connection, folder: str, query: str,
           limit: int) -> list[TranscriptHit]:
    """The `limit` best matches of `query` in `folder`'s transcript, best first (bm25; the
    newer first among equals). Snippets mark the matched words with MARK_OPEN/MARK_CLOSE."""
    expr = match_expression(folder, query)
    if expr is None or limit <= 0:
        return []
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


def count_rows(conn: sqlite3.Connection, folder: str | None = None) -> int:
    """How many transcript rows there are (of `folder`, or of every group)."""
    if folder is None:
        return int(conn.execute("SELECT COUNT(*) FROM transcript").fetchone()[0])
    return int(conn.execute("SELECT COUNT(*) FROM transcript WHERE group_folder = ?",
                            (folder,)).fetchone()[0])
