"""Outbox delivery: every outbound row reaches its chat, or is marked failed with the reason.

The worker takes the oldest unfinished row of each chat (rows of one chat go out in order;
different chats go out side by side), finds the channel that owns the chat's JID, splits text
at the channel's limit and sends it. A failed send is retried with exponential backoff and
jitter (mdclaw.retry; the chat service's own "retry after" wins when longer); after the last
try, or at once for an error retrying cannot fix, the row becomes `failed` with the reason.
While the owning channel is not connected, rows wait without using up their tries. Pieces of
a split text already delivered are remembered (`outbox_progress`), so a retry resumes where
it stopped.

Crash safety: a row is `sending` only while a send is under way; `recover()` (run by
`start()` and `stop()`) puts rows a crash left `sending` back to `pending`, so they are sent
again (at least once: a crash after the chat took a message but before it was recorded
sends that message twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from mdclaw import metrics
from mdclaw.channels.base import Channel, ChannelError, channel_for
from mdclaw.retry import EQUAL_JITTER, Backoff
from mdclaw.schedule import from_iso, utc_now
from mdclaw.state import Database, now_iso
from mdclaw.state.outbox import OutboxRow, enqueue

log = logging.getLogger("mdclaw.outbox")

YIELD_EVERY = 16  # deliveries of one chat between yields to the event loop
ROUND_PER_CHAT = 256  # deliveries of one chat per round of the background worker


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a row is retried.

    After the n-th failed attempt the next one waits base_delay * factor**(n-1) seconds,
    at most max_delay, shortened at random by up to `jitter` of itself (equal jitter by
    default, see mdclaw.retry.Backoff; 0 for exact delays); after max_attempts attempts the
    row is failed.
    """

    max_attempts: int = 5
    base_delay: float = 5.0
    factor: float = 3.0
    max_delay: float = 600.0
    jitter: float = EQUAL_JITTER
    rng: random.Random | None = field(default=None, repr=False, compare=False)
    _backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.base_delay < 0 or self.factor < 1:
            raise ValueError("max_attempts >= 1, base_delay >= 0 and factor >= 1 are needed")
        object.__setattr__(self, "_backoff", Backoff(
            base=self.base_delay, factor=self.factor, cap=self.max_delay, jitter=self.jitter,
            rng=self.rng))

    def delay(self, attempts: int) -> float:
        """Seconds to wait after `attempts` failed attempts."""
        return self._backoff.delay(attempts)


RowCallback = Callable[[OutboxRow], Any]


class OutboxWorker:
    """Delivers outbox rows through `channels` (a list the caller may change later with
    `set_channels`). `on_sent` / `on_failed` are called with the final row."""

    def __init__(self, db: Database, channels: Iterable[Channel] = (), *,
                 policy: RetryPolicy | None = None, on_sent: RowCallback | None = None,
                 on_failed: RowCallback | None = None, max_idle: float = 60.0,
                 max_parallel_chats: int = 8, disconnected_recheck: float = 10.0) -> None:
        self.db = db
        self.channels: list[Channel] = list(channels)
        self.policy = policy or RetryPolicy()
        self.on_sent = on_sent
        self.on_failed = on_failed
        self.max_idle = max_idle
        # How often rows for a channel that is down are looked at again (they keep their
        # tries: a chat outage delays messages, it does not fail them).
        self.disconnected_recheck = disconnected_recheck
        self._sem = asyncio.Semaphore(max_parallel_chats)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def set_channels(self, channels: Iterable[Channel]) -> None:
        self.channels = list(channels)
        self.wake()

    # ------------------------------------------------------------------ lifecycle
    def recover(self) -> int:
        """Put rows left `sending` (by a crash or a cancelled send) back to pending, due now.
        Returns how many."""
        now = now_iso()
        with self.db.transaction() as c:
            return c.execute(
                "UPDATE outbox SET status = 'pending', next_attempt_at = ?, updated_at = ? "
                "WHERE status = 'sending'", (now, now)).rowcount

    async def start(self) -> None:
        """Recover interrupted rows and start delivering in the background."""
        if self._task is not None:
            return
        n = self.recover()
        if n:
            log.info("outbox: %d message(s) interrupted by a restart will be sent again", n)
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="outbox-worker")

    async def stop(self, timeout: float = 5.0) -> None:
        """Let a send under way finish (up to `timeout` s), stop, and leave no row `sending`.
        If the caller is cancelled meanwhile, the worker is stopped all the same and the
        cancel passed on."""
        task, self._task = self._task, None
        self._stopping = True
        self._wake.set()
        try:
            if task is not None:
                try:
                    # asyncio.wait neither cancels the worker on timeout nor raises how it
                    # ended; only a cancel of this task comes out of it.
                    await asyncio.wait([task], timeout=timeout)
                finally:
                    if not task.done():  # past the grace, or this stop was cancelled
                        task.cancel()  # its send stays `sending`; recover() puts it back
                        await asyncio.wait([task])
        finally:
            self.recover()

    def wake(self) -> None:
        """Look for due rows now (call after enqueueing)."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            try:
                # Bounded rounds: a chat that is flooded does not hold back rows of chats
                # that get theirs meanwhile; the next round starts at once if more is due.
                await self.run_once(per_chat=ROUND_PER_CHAT)
            except Exception:  # noqa: BLE001 - the worker must not die: a locked database, a bug
                log.exception("outbox: delivery round failed; trying again shortly")
                await asyncio.sleep(1.0)
            if self._stopping:
                break
            due_in = self.next_due_in()
            timeout = self.max_idle if due_in is None else min(due_in, self.max_idle)
            if timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)

    # ------------------------------------------------------------------ queries
    def _heads(self) -> list[OutboxRow]:
        """The oldest unfinished row of every chat."""
        rows = self.db.query(
            """SELECT o.* FROM outbox o JOIN (
                   SELECT chat_jid, MIN(id) AS id FROM outbox
                   WHERE status IN ('pending', 'sending') GROUP BY chat_jid) h ON o.id = h.id
               ORDER BY o.id""")
        return [OutboxRow(**{k: r[k] for k in OutboxRow.__dataclass_fields__}) for r in rows]

    def next_due_in(self) -> float | None:
        """Seconds until the next chat's head row is due (0 if one is); None if none waits."""
        heads = [h for h in self._heads() if h.status == "pending" and not h.waiting_for_copy]
        if not heads:
            return None
        soonest = min(h.next_attempt_at or "" for h in heads)
        if not soonest:
            return 0.0
        return max(0.0, (from_iso(soonest) - utc_now()).total_seconds())

    # ------------------------------------------------------------------ delivery
    async def run_once(self, per_chat: int | None = None) -> int:
        """Deliver every row that is due now (at most `per_chat` of each chat); return how
        many rows reached sent or failed."""
        now = now_iso()
        heads = [(h.chat_jid, h.id) for h in self._heads()
                 if h.status == "pending" and not h.waiting_for_copy
                 and (h.next_attempt_at or "") <= now]
        if not heads:
            return 0
        counts = await asyncio.gather(*(self._drain_chat(jid, hid, per_chat)
                                        for jid, hid in heads))
        return sum(counts)

    def _next_rows(self, jid: str, after: int, limit: int = 64) -> list[OutboxRow]:
        """The chat's next unfinished rows after id `after`, in order (a range seek in
        idx_outbox_chat, whose entries are ordered by chat, then id: rows already sent are
        not walked again)."""
        rows = self.db.query(
            "SELECT * FROM outbox WHERE chat_jid = ? AND id > ? AND status IN "
            "('pending', 'sending') ORDER BY id LIMIT ?", (jid, after, limit))
        return [_to_row(r) for r in rows]

    async def _drain_chat(self, jid: str, head_id: int, limit: int | None = None) -> int:
        """Deliver the chat's rows in order until one is not due, waits or fails (or
        `limit` were delivered)."""
        done = 0
        unmarked: OutboxRow | None = None  # sent; its `sent` mark goes with the next claim
        async with self._sem:
            after = head_id - 1
            try:
                while not self._stopping:
                    rows = self._next_rows(jid, after)
                    if not rows:
                        return done
                    now = now_iso()
                    for row in rows:
                        if (self._stopping or row.status != "pending" or row.waiting_for_copy
                                or (row.next_attempt_at or "") > now):
                            return done
                        prev, unmarked = unmarked, None
                        finished, unmarked = await self._deliver(row, prev)
                        if not finished:
                            return done
                        done += 1
                        after = row.id
                        if limit is not None and done >= limit:
                            return done
                        if done % YIELD_EVERY == 0:
                            # A chat service's send usually waits on the network; one that
                            # does not must still let the IPC loop and other chats run.
                            # No row stays `sending` over the pause.
                            if unmarked is not None:
                                self._mark_sent(unmarked)
                                unmarked = None
                            await asyncio.sleep(0)
            finally:
                if unmarked is not None:
                    self._mark_sent(unmarked)
        return done

    def _claim(self, row: OutboxRow, sent: OutboxRow | None = None) -> bool:
        """Mark `row` as being sent; `sent` (the chat's previous row, just delivered) is
        marked sent in the same transaction."""
        now = now_iso()
        with self.db.transaction() as c:
            if sent is not None:
                self._sent_in(c, sent, now)
            claimed = c.execute(
                "UPDATE outbox SET status = 'sending', attempts = attempts + 1, updated_at = ? "
                "WHERE id = ? AND status = 'pending'", (now, row.id)).rowcount == 1
        if sent is not None:
            self._after_sent(sent)
        return claimed

    @staticmethod
    def _sent_in(c: Any, row: OutboxRow, now: str) -> None:
        c.execute("UPDATE outbox SET status = 'sent', sent_at = ?, updated_at = ?, "
                  "next_attempt_at = NULL WHERE id = ?", (now, now, row.id))
        c.execute("DELETE FROM outbox_progress WHERE outbox_id = ?", (row.id,))

    def _mark_sent(self, row: OutboxRow) -> None:
        with self.db.transaction() as c:
            self._sent_in(c, row, now_iso())
        self._after_sent(row)

    def _after_sent(self, row: OutboxRow) -> None:
        log.info("outbox: message %d sent to %s (try %d)", row.id, row.chat_jid,
                 row.attempts + 1)
        self._callback(self.on_sent, row.id)

    def _parts_sent(self, row_id: int) -> int:
        r = self.db.query_one("SELECT parts_sent FROM outbox_progress WHERE outbox_id = ?",
                              (row_id,))
        return int(r[0]) if r else 0

    def _set_parts_sent(self, row_id: int, n: int) -> None:
        with self.db.transaction() as c:
            c.execute("INSERT INTO outbox_progress (outbox_id, parts_sent) VALUES (?, ?) "
                      "ON CONFLICT(outbox_id) DO UPDATE SET parts_sent = excluded.parts_sent",
                      (row_id, n))

    async def _send(self, ch: Channel, row: OutboxRow) -> None:
        if row.kind == "text":
            if not (row.text or "").strip():
                raise ChannelError("the message is empty", permanent=True)
            parts = ch.message_parts(row.text or "")
            # Progress is recorded only during an attempt: a row never tried has none.
            start = self._parts_sent(row.id) if row.attempts else 0
            for i in range(start, len(parts)):
                await ch.send_part(row.chat_jid, parts[i],
                                   reply_to=row.reply_to if i == 0 else None,
                                   sender=row.sender)
                if len(parts) > 1:
                    self._set_parts_sent(row.id, i + 1)
        elif row.kind == "file":
            if not row.file_path:
                raise ChannelError("the file row names no file", permanent=True)
            await ch.send_file(row.chat_jid, Path(row.file_path), file_name=row.file_name,
                               caption=row.text)
        elif row.kind == "reaction":
            if not row.message_id or not row.emoji:
                raise ChannelError("the reaction names no message or emoji", permanent=True)
            await ch.react(row.chat_jid, row.message_id, row.emoji)
        else:
            raise ChannelError(f"unknown outbox kind {row.kind!r}", permanent=True)

    async def _deliver(self, row: OutboxRow, sent: OutboxRow | None = None
                       ) -> tuple[bool, OutboxRow | None]:
        """One attempt at `row`, after marking `sent` (the chat's previous row, delivered)
        sent. Returns (True if it reached sent or failed, False if rescheduled; the row if it
        was delivered and its `sent` mark is still to be written, else None)."""
        ch = channel_for(self.channels, row.chat_jid)
        if ch is not None and not ch.is_connected():
            if sent is not None:
                self._mark_sent(sent)
            # An outage delays messages, it does not use up their tries: look again soon.
            self._defer(row, f"waiting: the {ch.name} channel is not connected")
            return False, None
        if not self._claim(row, sent):
            return False, None
        attempt = row.attempts + 1
        try:
            if ch is None:
                raise ChannelError(f"no channel serves {row.chat_jid} (is its channel "
                                   "configured under channels:?)")
            await self._send(ch, row)
        except asyncio.CancelledError:
            raise  # stays `sending`; recover() puts it back
        except ChannelError as e:
            reason = ch.redact(str(e)) if ch else str(e)
            return self._count_failed(ch, self._failed_attempt(
                row, attempt, reason, e.permanent, e.retry_after)), None
        except Exception as e:  # noqa: BLE001 - a channel's bug is a failed attempt, not a crash
            # A channel bug: keep the type for the record; the text might hold anything
            # (a token, say), so neither it nor a traceback is logged.
            log.error("outbox: the %s channel raised %s for message %d",
                      ch.name if ch else "?", type(e).__name__, row.id)
            return self._count_failed(ch, self._failed_attempt(
                row, attempt, f"internal error in the {ch.name if ch else '?'} channel: "
                f"{type(e).__name__}", False, None)), None
        metrics.outbox_attempts.get(ch.name, "sent").inc()
        with contextlib.suppress(ValueError):
            metrics.outbox_delivery.get(ch.name).observe(
                (utc_now() - from_iso(row.created_at)).total_seconds())
        return True, row

    @staticmethod
    def _count_failed(ch: Channel | None, finished: bool) -> bool:
        metrics.outbox_attempts.get(ch.name if ch else "none",
                                    "failed" if finished else "retry").inc()
        return finished

    def _defer(self, row: OutboxRow, reason: str) -> None:
        now = utc_now()
        wait = min(self.disconnected_recheck, self.policy.delay(row.attempts + 1))
        with self.db.transaction() as c:
            c.execute("UPDATE outbox SET last_error = ?, next_attempt_at = ?, updated_at = ? "
                      "WHERE id = ? AND status = 'pending'",
                      (reason, now_iso(now + timedelta(seconds=wait)), now_iso(now), row.id))

    def _failed_attempt(self, row: OutboxRow, attempt: int, reason: str, permanent: bool,
                        retry_after: float | None) -> bool:
        now = utc_now()
        if permanent or attempt >= self.policy.max_attempts:
            why = (f"not retried: {reason}" if permanent and attempt < self.policy.max_attempts
                   else f"gave up after {attempt} attempt(s): {reason}")
            with self.db.transaction() as c:
                c.execute("UPDATE outbox SET status = 'failed', last_error = ?, "
                          "next_attempt_at = NULL, updated_at = ? WHERE id = ?",
                          (why, now_iso(now), row.id))
            log.warning("outbox: message %d to %s failed: %s", row.id, row.chat_jid, why)
            self._callback(self.on_failed, row.id)
            return True
        wait = max(self.policy.delay(attempt), retry_after or 0.0)
        with self.db.transaction() as c:
            c.execute("UPDATE outbox SET status = 'pending', last_error = ?, "
                      "next_attempt_at = ?, updated_at = ? WHERE id = ?",
                      (f"attempt {attempt}/{self.policy.max_attempts}: {reason}",
                       now_iso(now + timedelta(seconds=wait)), now_iso(now), row.id))
        log.info("outbox: message %d to %s: attempt %d failed (%s); next in %.1f s",
                 row.id, row.chat_jid, attempt, reason, wait)
        return False

    def _callback(self, cb: RowCallback | None, row_id: int) -> None:
        if cb is None:
            return
        row = get_row(self.db, row_id)
        if row is None:
            return
        try:
            result = cb(row)
            if asyncio.iscoroutine(result):
                asyncio.ensure_future(result)
        except Exception:  # noqa: BLE001 - the owner's callback: the row is already final
            log.exception("outbox: result callback failed for message %d", row_id)


def service_replier(db: Database, wake: Callable[[], None]) -> Callable[[str, str, str | None],
                                                                         None]:
    """The callback channels queue their own answers with (`/chatid`): a text row in the
    outbox, delivered and retried like any reply (a 429 delays it, it is not lost)."""

    def reply(jid: str, text: str, reply_to: str | None) -> None:
        with db.transaction() as c:
            enqueue(c, chat_jid=jid, kind="text", text=text, reply_to=reply_to)
        wake()

    return reply


# ---------------------------------------------------------------------- queries for others


def spool_cleaner(spool_dir: Path) -> RowCallback:
    """An on_sent/on_failed callback that deletes a file row's host copy once the row is
    final, when the copy lives in `spool_dir` (the IPC engine copies files agents send there;
    anything else is left alone)."""
    spool = spool_dir.resolve()

    def clean(row: OutboxRow) -> None:
        if row.kind != "file" or not row.file_path:
            return
        path = Path(row.file_path)
        if path.parent.resolve() == spool:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    return clean


def _to_row(r: Any) -> OutboxRow:
    return OutboxRow(**{k: r[k] for k in OutboxRow.__dataclass_fields__})


def get_row(db: Database, row_id: int) -> OutboxRow | None:
    r = db.query_one("SELECT * FROM outbox WHERE id = ?", (row_id,))
    return _to_row(r) if r else None


def failed_since(db: Database, group_folder: str, since: str | None = None) -> list[OutboxRow]:
    """Rows of `group_folder` that became `failed` after `since` (ISO UTC; None: ever),
    oldest first: what the group's next agent run should be told did not arrive."""
    rows = db.query(
        "SELECT * FROM outbox WHERE source_group = ? AND status = 'failed' AND updated_at > ? "
        "ORDER BY id", (group_folder, since or ""))
    return [_to_row(r) for r in rows]


def describe_failures(rows: Iterable[OutboxRow], limit: int = 10,
                      preview: int = 80) -> str:
    """A short plain-text list of failed rows for an agent prompt ('' for none)."""
    lines = []
    rows = list(rows)
    for row in rows[-limit:]:
        what = {"text": f"message {(row.text or '')[:preview]!r}",
                "file": f"file {row.file_name or Path(row.file_path or '').name!r}",
                "reaction": f"reaction {row.emoji!r}"}.get(row.kind, row.kind)
        lines.append(f"- {what} to {row.chat_jid} at {row.created_at}: {row.last_error}")
    if len(rows) > limit:
        lines.insert(0, f"({len(rows) - limit} older failure(s) not shown)")
    return "\n".join(lines)


def outbox_counts(db: Database) -> dict[str, int]:
    """Number of rows per status (every status present, zero when none)."""
    counts = {s: 0 for s in ("pending", "sending", "sent", "failed")}
    for r in db.query("SELECT status, COUNT(*) FROM outbox GROUP BY status"):
        counts[r[0]] = int(r[1])
    return counts
