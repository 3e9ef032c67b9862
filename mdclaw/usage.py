"""The usage ledger: model requests and tokens per group, model and UTC day.

The credential proxy (mdclaw.proxy) hands every response it forwards to a `UsageCounter`,
which reads the token counts the API reports (a JSON body or server-sent events, OpenAI or
Anthropic), and then counts the request in its `UsageLedger`. The ledger adds counts up in
memory and writes them to the state database (`model_usage`) every `flush_interval` seconds,
when a group's proxy stops and at `close` — one small transaction instead of one per request,
which keeps database work off the request path (a crash loses at most one interval's counts).

`tokens_today` is what the daily token budget (mdclaw.budget) is measured against: the
database's rows plus the counts not yet written. `mdclaw usage` and the operator page read the
rows back with `usage_rows` and `daily_usage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from mdclaw import metrics
from mdclaw.state import Database, now_iso

# Logged under the name these lines had before they moved here, so that journal filters
# and log readers keep working.
log = logging.getLogger("mdclaw.proxy")

MAX_BUFFERED_JSON = 8 * 1024 * 1024  # bytes of one response kept to read its usage


@dataclass
class UsageCounter:
    """Tokens seen in one response: JSON body or server-sent events, OpenAI or Anthropic.

    Counts are cumulative in both APIs' streams, so the largest value seen wins. `final`: the
    answer's closing usage was seen (a JSON body's, a Messages stream's `message_delta`, a
    Chat Completions stream's usage chunk), so the counts are the API's last word; a
    Messages stream's `message_start` reports the input, but not yet the answer.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    final: bool = False
    _pending: bytes = b""
    _json: bytearray = field(default_factory=bytearray)
    _json_overflow: bool = False

    def take(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return

        def num(*keys: str) -> int:
            total = 0
            for k in keys:
                v = usage.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    total += v
            return total

        self.input_tokens = max(self.input_tokens, num("input_tokens", "prompt_tokens",
                                                       "cache_creation_input_tokens",
                                                       "cache_read_input_tokens"))
        self.output_tokens = max(self.output_tokens, num("output_tokens", "completion_tokens"))

    def take_object(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        self.take(usage)
        if isinstance(usage, dict) and obj.get("type") != "message_start":
            self.final = True
        message = obj.get("message")
        if isinstance(message, dict):
            self.take(message.get("usage"))

    def feed_sse(self, chunk: bytes) -> None:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > MAX_BUFFERED_JSON:  # a runaway line: stop looking at it
            self._pending = b""
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:") or b"usage" not in line:
                continue
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self.take_object(json.loads(line[5:].strip()))

    def feed_json(self, chunk: bytes) -> None:
        if self._json_overflow:
            return
        if len(self._json) + len(chunk) > MAX_BUFFERED_JSON:
            self._json_overflow = True
            self._json.clear()
            return
        self._json.extend(chunk)

    def finish(self) -> None:
        if self._pending:
            self.feed_sse(b"\n")
        if self._json:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self.take_object(json.loads(bytes(self._json)))
            self._json.clear()


# --------------------------------------------------------------------------- the table

_UPSERT = """INSERT INTO model_usage (group_folder, day, model, requests, errors,
                   input_tokens, output_tokens, updated_at)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (group_folder, day, model) DO UPDATE SET
                   requests = requests + excluded.requests,
                   errors = errors + excluded.errors,
                   input_tokens = input_tokens + excluded.input_tokens,
                   output_tokens = output_tokens + excluded.output_tokens,
                   updated_at = excluded.updated_at"""


def record_usage(db: Database, folder: str, model: str, *, ok: bool, input_tokens: int,
                 output_tokens: int, when: str | None = None) -> None:
    """Add one request to the group's row for its day."""
    stamp = when or now_iso()
    with db.transaction() as conn:
        conn.execute(_UPSERT, (folder, stamp[:10], model, 1, 0 if ok else 1, input_tokens,
                               output_tokens, stamp))


def record_usage_batch(db: Database, rows: dict[tuple[str, str, str], list[int]]) -> None:
    """Add accumulated counts {(folder, day, model): [requests, errors, in, out]} in one
    transaction."""
    stamp = now_iso()
    with db.transaction() as conn:
        conn.executemany(_UPSERT, [(f, d, m, r, e, i, o, stamp)
                                   for (f, d, m), (r, e, i, o) in rows.items()])


def tokens_on_day(db: Database, folder: str, day: str) -> int:
    """Tokens (input + output) the group's requests used on UTC day `day` (YYYY-MM-DD), as
    written to the database."""
    rows = db.query("SELECT COALESCE(SUM(input_tokens + output_tokens), 0) AS n "
                    "FROM model_usage WHERE group_folder = ? AND day = ?", (folder, day))
    return int(rows[0]["n"]) if rows else 0


def _usage_filter(group: str | None, since_day: str | None) -> tuple[str, tuple[str, ...]]:
    """The WHERE clause (fixed column names only) and its parameters for a usage query."""
    where, params = [], []
    if group:
        where.append("group_folder = ?")
        params.append(group)
    if since_day:
        where.append("day >= ?")
        params.append(since_day)
    return (" WHERE " + " AND ".join(where) if where else ""), tuple(params)


def usage_rows(db: Database, *, group: str | None = None,
               since_day: str | None = None) -> list[dict[str, Any]]:
    """Usage totals per group and model (summed over days from `since_day` on)."""
    where, params = _usage_filter(group, since_day)
    # Fixed column names only; every value is a parameter.
    sql = ("SELECT group_folder, model, SUM(requests) AS requests, SUM(errors) AS errors, "  # noqa: S608, E501
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens, "
           "MIN(day) AS first_day, MAX(day) AS last_day FROM model_usage" + where
           + " GROUP BY group_folder, model ORDER BY group_folder, model")
    return [dict(r) for r in db.query(sql, params)]


def daily_usage(db: Database, *, group: str | None = None, since_day: str | None = None,
                by_model: bool = False) -> list[dict[str, Any]]:
    """Usage per group and UTC day (summed over models; `by_model`: per model too, each row
    with its `model`), oldest day first."""
    where, params = _usage_filter(group, since_day)
    model = ", model" if by_model else ""
    # Fixed column names only; every value is a parameter.
    sql = (f"SELECT group_folder, day{model}, SUM(requests) AS requests, "  # noqa: S608
           "SUM(errors) AS errors, "
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens "
           "FROM model_usage" + where
           + f" GROUP BY group_folder, day{model} ORDER BY day, group_folder{model}")
    return [dict(r) for r in db.query(sql, params)]


# --------------------------------------------------------------------------- the ledger


def _zero() -> dict[str, int]:
    return {"requests": 0, "errors": 0, "input_tokens": 0, "output_tokens": 0}


class UsageLedger:
    """Counts model requests per group in memory and writes them to `db` now and then.

    Use inside a running event loop. `db` may be None: then nothing is persisted and the
    counts stay in `stats` ({folder: {requests, errors, input_tokens, output_tokens}} since
    the ledger was made). `track(folder)` when a group's proxy starts (it starts the periodic
    flush), `count` once per forwarded request, `flush` to write now, `close` at shutdown.
    """

    def __init__(self, db: Database | None, *, flush_interval: float = 5.0) -> None:
        self.db = db
        self.flush_interval = flush_interval
        self.stats: dict[str, dict[str, int]] = {}
        # (folder, UTC day, model) -> [requests, errors, input tokens, output tokens] counted
        # and not yet written.
        self._unflushed: dict[tuple[str, str, str], list[int]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._flush_lock = asyncio.Lock()
        # folder -> [UTC day, tokens used that day] (the database's count plus every request
        # counted since it was read), for the daily token budget.
        self._today: dict[str, list[Any]] = {}

    def track(self, folder: str) -> None:
        """`folder`'s requests are about to be counted: show it in `stats` (with zeros) and
        make sure the periodic flush runs."""
        self.stats.setdefault(folder, _zero())
        if self.db is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.ensure_future(self._flush_loop())

    def count(self, folder: str, model: str, *, ok: bool, input_tokens: int = 0,
              output_tokens: int = 0) -> None:
        """Count one request of `folder` to `model` (its outcome and the tokens reported)."""
        s = self.stats.setdefault(folder, _zero())
        s["requests"] += 1
        s["errors"] += 0 if ok else 1
        s["input_tokens"] += input_tokens
        s["output_tokens"] += output_tokens
        label = metrics.model_label(model or "default")
        metrics.proxy_requests.get(folder, label, "ok" if ok else "error").inc()
        if input_tokens:
            metrics.proxy_tokens.get(folder, label, "input").inc(input_tokens)
        if output_tokens:
            metrics.proxy_tokens.get(folder, label, "output").inc(output_tokens)
        day = now_iso()[:10]
        today = self._today.get(folder)
        if today is not None and today[0] == day:
            today[1] += input_tokens + output_tokens
        if self.db is None:
            return
        row = self._unflushed.setdefault((folder, day, model), [0, 0, 0, 0])
        row[0] += 1
        row[1] += 0 if ok else 1
        row[2] += input_tokens
        row[3] += output_tokens

    async def tokens_today(self, folder: str) -> int:
        """Tokens the group used today (UTC): the database's rows plus the counts not yet
        written. Read from the database once a day per group, then kept up to date by
        every counted request."""
        day = now_iso()[:10]
        got = self._today.get(folder)
        if got is not None and got[0] == day:
            return int(got[1])
        async with self._flush_lock:  # no counts in flight between memory and database
            n = (await asyncio.to_thread(tokens_on_day, self.db, folder, day)
                 if self.db is not None else 0)
            n += sum(v[2] + v[3] for (f, d, _m), v in self._unflushed.items()
                     if f == folder and d == day)
            self._today[folder] = [day, n]
        return n

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            await self.flush()

    async def flush(self) -> None:
        """Write every counted request to the database now."""
        if self.db is None:
            return
        async with self._flush_lock:
            if not self._unflushed:
                return
            rows, self._unflushed = self._unflushed, {}
            try:
                await asyncio.to_thread(record_usage_batch, self.db, rows)
            except sqlite3.Error as e:  # locked past the busy timeout, disk full...
                log.error("could not record model usage (kept for the next try): %s", e)
                for k, v in rows.items():
                    cur = self._unflushed.setdefault(k, [0, 0, 0, 0])
                    for i in range(4):
                        cur[i] += v[i]

    async def close(self) -> None:
        """Stop the periodic flush and write what is left."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        await self.flush()
