"""Outbox delivery: every outbound row reaches its chat, or is marked failed with the reason.

The worker takes the oldest unfinished row of each chat (rows of one chat go out in order;
different chats go out side by side), finds the channel that owns the chat's JID, splits text
at the channel's limit and sends it. A failed send is retried with exponential backoff and
jitter (mdclaw.retry; the chat service's own "retry after" wins when longer); after the last
try, or at once for an error retrying cannot fix, the row becomes `failed` with the reason.
While the owning channel is not connected, rows wait without using up their tries. Pieces of
a split text already delivered are remembered (`outbox_progress`), so a retry resumes where
it stopped.

Crash safety: a row is `sending` from its claim until it is marked sent, failed or back to
pending; `recover()` (run by `start()` and `stop()`) puts rows a crash left `sending` back to
`pending`, so they are sent again (at least once). A chat's rows are claimed up to BATCH at a
time. Claims and `sent` marks of all chats are written together, one transaction behind the
drains that asked for them in a turn of the event loop; a drain that goes on past its first
batch writes its next claim at once, with the marks of the batch it delivered. A delivered
row is marked as soon as its chat's drain waits for anything (a send that waits on the
network, its next claim, its end), and in the same turn of the loop when it does not (a
row handed over on Python 3.12+, EAGER_START: before hand_off returns). So a
crash sends again, per chat, the row in flight and the rows delivered since the drain last
waited: at most BATCH rows, MARKS_MAX in all, and only the row in flight with a chat
service whose sends wait on the network. At most `max_parallel_chats` chats send at once (a
chat waiting for its claim to be written does not count). Rows claimed but not yet tried
when a crash stops them have one try counted that was not made.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import sqlite3
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from mdclaw import metrics
from mdclaw.channels.base import (
    Card,
    Channel,
    ChannelError,
    LocalText,
    channel_for,
    delivering,
)
from mdclaw.config import Config, Limits, LiveConfig
from mdclaw.retry import EQUAL_JITTER, Backoff
from mdclaw.schedule import from_iso, utc_now
from mdclaw.state import Database, now_iso
from mdclaw.state.outbox import OutboxRow, enqueue, outbox_row, outbox_rows

log = logging.getLogger("mdclaw.outbox")

# Python 3.12+ can run a task's first step at once, in the turn that makes it (eager_start):
# a row handed over (hand_off) is then sent, and its `sent` mark written, in the IPC round's
# own turn of the event loop, not one turn later. Older Pythons queue the first step.
EAGER_START = sys.version_info >= (3, 12)

BATCH = 16  # rows of one chat claimed at a time: bounds the duplicates a crash can cause
ROUND_PER_CHAT = 256  # deliveries of one chat per round of the background worker
# `sent` marks waiting for their flush, in all: more (many chats delivered in one turn of the
# loop by a chat service that answers without waiting) are written at once.
MARKS_MAX = 128


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

    @classmethod
    def from_limits(cls, limits: Limits) -> RetryPolicy:
        """`limits.delivery_attempts` tries, the second `limits.delivery_retry_base` after
        the first."""
        return cls(max_attempts=limits.delivery_attempts,
                   base_delay=limits.delivery_retry_base.total_seconds())


RowCallback = Callable[[OutboxRow], Any]


class OutboxWorker:
    """Delivers outbox rows through `channels` (a list the caller may change later with
    `set_channels`). `on_sent` / `on_failed` are called with the final row.

    Failed deliveries are retried by `policy`, or, given `cfg` instead (a LiveConfig, or a
    plain Config), by the config's `limits.delivery_*` in force when the failure happens."""

    def __init__(self, db: Database, channels: Iterable[Channel] = (), *,
                 policy: RetryPolicy | None = None, cfg: Config | LiveConfig | None = None,
                 on_sent: RowCallback | None = None,
                 on_failed: RowCallback | None = None, max_idle: float = 60.0,
                 max_parallel_chats: int = 8, disconnected_recheck: float = 10.0) -> None:
        self.db = db
        self.channels: list[Channel] = list(channels)
        self.live = LiveConfig.of(cfg) if cfg is not None else None
        self._policy = policy or (None if self.live is not None else RetryPolicy())
        self._policy_of: tuple[Limits, RetryPolicy] | None = None
        self.on_sent = on_sent
        self.on_failed = on_failed
        self.max_idle = max_idle
        # How often rows for a channel that is down are looked at again (they keep their
        # tries: a chat outage delays messages, it does not fail them).
        self.disconnected_recheck = disconnected_recheck
        self._sem = asyncio.Semaphore(max_parallel_chats)
        self._wake = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        # Writes the chats' drains ask for in one turn of the event loop, made together in
        # one transaction by _flush (see _drain_chat).
        self._claims: list[tuple[list[OutboxRow], asyncio.Future[list[OutboxRow]]]] = []
        self._marks: list[OutboxRow] = []  # delivered, `sent` mark not yet written
        self._releases: list[OutboxRow] = []  # claimed, not tried: back to pending
        self._flush_at: asyncio.Handle | None = None  # the flush queued on the loop
        self._handing_off = False  # hand_off writes what its drains ask for as it ends
        self._retry_flush: asyncio.Handle | None = None  # after a flush that failed
        self._active: dict[str, asyncio.Task[int]] = {}  # the drain under way, by chat
        self._parted: set[int] = set()  # rows whose parts were recorded (outbox_progress)
        self._wakes = 0  # wake() calls so far (a drain that saw none has no rows to look for)
        self._retry_at = 0.0  # monotonic time before which a failed round is not retried

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy for a delivery that fails now."""
        if self._policy is not None:
            return self._policy
        assert self.live is not None
        limits = self.live.current.limits
        if self._policy_of is None or self._policy_of[0] is not limits:
            self._policy_of = (limits, RetryPolicy.from_limits(limits))
        return self._policy_of[1]

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
        self.wake()
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
            for handle in (self._flush_at, self._retry_flush):
                if handle is not None:
                    handle.cancel()
            self._flush_at = self._retry_flush = None
            try:
                self._flush()  # the marks of rows delivered: not sent again after a restart
            except Exception:  # noqa: BLE001 - recover() must still run
                log.exception("outbox: could not record the last deliveries before stopping")
            self.recover()

    def wake(self) -> None:
        """Look for due rows now (call after enqueueing)."""
        self._wakes += 1
        self._wake.set()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _sleep(self, timeout: float) -> None:
        """Wait until woken or `timeout` s. A plain future: the worker runs in the very next
        turn of the event loop after wake() (waiting on the Event through wait_for takes
        three, each of which may be a whole IPC round during a burst)."""
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()

        def ring() -> None:
            if not fut.done():
                fut.set_result(None)

        timer = loop.call_later(timeout, ring)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ------------------------------------------------------------------ hand-off
    def accepts(self, jid: str) -> bool:
        """True if a new row of chat `jid` may be written already claimed and handed to this
        worker after COMMIT (hand_off) instead of waiting for its next look: the worker runs,
        no drain of the chat is under way and its channel is connected. The writer checks in
        its own transaction that the chat has no unfinished row (has_open_rows), so the row
        is the chat's next in order."""
        if self._task is None or self._stopping or jid in self._active:
            return False
        ch = channel_for(self.channels, jid)
        return ch is not None and ch.is_connected()

    def hand_off(self, rows: list[OutboxRow]) -> bool:
        """Deliver rows committed already claimed (`sending`, a try counted: enqueue with
        `claimed`), each the only unfinished row of its chat, at once: no look for due rows
        and no claim of their own. Each is given as the worker holds a row it claimed: as
        it was before the claim (`pending`, its earlier tries). Their `sent` marks are
        written as any delivery's. If the worker stops first, they stay `sending` and
        recover() puts them back to pending.

        With EAGER_START each drain's first step runs in this call: a send that does not
        wait on the network is made, and the marks (and anything else the drains asked
        for) are written in one transaction before this returns. True then: every row's
        send has started by the time this returns. False: their first steps come in the
        next turn of the loop, the flush behind them."""
        self._handing_off = EAGER_START
        try:
            for row in rows:
                if self._task is None or self._stopping or row.chat_jid in self._active:
                    # Not expected (accepts() said yes in this turn of the loop): the row
                    # stays `sending` until recover(); make sure that comes.
                    log.warning("outbox: message %d handed over while it cannot be taken; "
                                "it is sent after the next start", row.id)
                    continue
                self._start_drain(row, 1, claimed=[row], eager=EAGER_START)
        finally:
            self._handing_off = False
        if EAGER_START:
            self._flush_now()
        else:
            self._flush_behind()
        return EAGER_START

    def writes_locally(self, jid: str) -> bool:
        """True if chat `jid`'s channel delivers by writing this database (the local chat
        page): a text to it, once accepts() says the worker takes the chat now, may be
        delivered in the writer's own transaction (write_locally)."""
        ch = channel_for(self.channels, jid)
        return ch is not None and ch.writes_locally

    def write_locally(self, conn: sqlite3.Connection, jid: str, text: str | None, *,
                      reply_to: str | None, sender: str | None
                      ) -> Callable[[], None] | None:
        """Deliver `text` to chat `jid` by its channel's rows written through `conn`, in
        the caller's open transaction, where the caller writes the message's outbox row
        `sent` as well: the command, its outbox row and the chat page's row commit
        together, or none of them. Returns what is to be done once the transaction has
        committed (give it to written_locally), or None, with nothing written, when the
        text cannot go this way (the channel does not write locally, the text is empty or
        more than one message, the channel refuses it): the caller then writes its row
        the usual way."""
        ch = channel_for(self.channels, jid)
        if ch is None or not ch.writes_locally:
            return None
        one = self._one_message(ch, text)  # (an empty text: the usual way fails it)
        if one is None:
            return None
        try:
            return ch.write_texts(conn, jid, [LocalText(one, reply_to, sender)])
        except ChannelError:
            return None

    def written_locally(self, rows: list[tuple[OutboxRow, Callable[[], None]]]) -> None:
        """Rows write_locally delivered, with what it returned, once their transaction has
        committed: the chat page woken, the delivery counted and reported as any."""
        for row, committed in rows:
            try:
                committed()
            except Exception:  # noqa: BLE001 - the row is written: the page's next look shows it
                log.exception("outbox: after writing message %d to %s", row.id, row.chat_jid)
            ch = channel_for(self.channels, row.chat_jid)
            metrics.outbox_attempts.get(ch.name if ch else "none", "sent").inc()
            metrics.outbox_delivery.get(ch.name if ch else "none").observe(0.0)
            self._marked(row, row.sent_at or now_iso(), tried=0)

    # ------------------------------------------------------------------ worker
    def _start_drain(self, head: OutboxRow, n: int | None,
                     claimed: list[OutboxRow] | None = None, *, eager: bool = False) -> None:
        coro = self._drain_then_look(head, n, claimed)
        if sys.version_info >= (3, 12) and eager:  # (EAGER_START, spelled out for mypy)
            task = asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)
            if task.done():
                return  # over within its first step: no drain of the chat is under way
        else:
            task = asyncio.create_task(coro)
        self._active[head.chat_jid] = task

    async def _drain_then_look(self, head: OutboxRow, n: int | None,
                               claimed: list[OutboxRow] | None) -> int:
        """A drain of the worker's (_drain_chat), then what its end calls for. A drain of
        rows handed over that delivered them, with no row queued since, ends here, in its
        own step: no done-callback, so no further turn of the loop for a message at a
        trickle. Otherwise the chat is looked at again a turn later (_drain_ended), once
        the `sent` marks queued behind the drain are written."""
        jid = head.chat_jid
        wakes = self._wakes
        try:
            done = await self._drain_chat(head, n, ROUND_PER_CHAT, first=claimed)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the worker goes on: a full look shortly
            log.error("outbox: delivery to %s failed: %r; trying again shortly", jid, e)
            self._retry_at = time.monotonic() + 1.0
            self.wake()
            return 0
        if self._stopping:
            return done
        if claimed is not None and wakes == self._wakes and done == len(claimed):
            # The rows handed over, delivered, and nobody queued a row since (whoever
            # does wakes the worker): the chat has nothing more to look for.
            return done
        asyncio.get_running_loop().call_soon(self._drain_ended, jid)
        return done

    def _drain_ended(self, jid: str) -> None:
        if jid in self._active:
            # The chat has a newer drain already (its next message was handed over as this
            # one ended: the chat had no unfinished row then; the drain took itself out of
            # _active as it ended): rows after it are its own.
            return
        if self._stopping:
            return
        # Rows the chat got while its drain ran: look at this chat alone (a seek in its
        # index), not at every chat's head (a walk of every unfinished row).
        try:
            head = self._head(jid)
        except Exception:  # noqa: BLE001 - a locked database: the full look finds it
            log.exception("outbox: looking for more rows of %s failed", jid)
            self.wake()
            return
        if head is None:
            return
        if (head.status == "pending" and not head.waiting_for_copy
                and (head.next_attempt_at or "") <= now_iso()):
            self._start_drain(head, None)
            self._flush_behind()
        else:
            self.wake()  # it waits (a retry later, a copy): the full look times it

    async def _run(self) -> None:
        # Each chat with due rows gets a drain of its own (at most ROUND_PER_CHAT rows, then
        # a new one if more is due): a flooded chat does not hold back rows of chats that
        # get theirs meanwhile, and a chat's new rows do not wait for other chats' drains.
        active = self._active
        cancelled = False
        try:
            while not self._stopping:
                self._wake.clear()
                try:
                    due_in: float | None = None
                    if time.monotonic() >= self._retry_at:
                        heads, due_in = self._due_heads(busy=set(active))
                        for head, n in heads:
                            self._start_drain(head, n)
                        if heads:
                            self._flush_behind()
                except Exception:  # noqa: BLE001 - the worker must not die: a locked database
                    log.exception("outbox: delivery round failed; trying again shortly")
                    self._retry_at = time.monotonic() + 1.0
                    due_in = 1.0
                if self._stopping:
                    break
                timeout = min(self.max_idle, self._retry_at - time.monotonic()
                              if self._retry_at > time.monotonic() else self.max_idle,
                              self.max_idle if due_in is None else due_in)
                if timeout > 0 and not self._wake.is_set():
                    await self._sleep(timeout)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            drains = list(active.values())
            me = asyncio.current_task()
            # (A cancel can also arrive as the wake-up wait ends, which then swallows it.)
            cancelled = cancelled or (me is not None and me.cancelling() > 0)
            try:
                if drains and not cancelled:
                    await asyncio.wait(drains)  # they stop at their next row
            finally:
                for task in drains:
                    task.cancel()  # a send under way stays `sending`; recover() puts it back
                if drains:
                    await asyncio.wait(drains)

    # ------------------------------------------------------------------ queries
    def _heads(self) -> list[OutboxRow]:
        """The oldest unfinished row of every chat."""
        rows = self.db.query(
            """SELECT o.* FROM outbox o JOIN (
                   SELECT chat_jid, MIN(id) AS id FROM outbox
                   WHERE status IN ('pending', 'sending') GROUP BY chat_jid) h ON o.id = h.id
               ORDER BY o.id""")
        return outbox_rows(rows)

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
    def _due_heads(self, busy: Collection[str] = ()
                   ) -> tuple[list[tuple[OutboxRow, int]], float | None]:
        """The head row of every chat (but those in `busy`) whose head is due now, with the
        chat's number of unfinished rows; and the seconds until the next of the other heads
        is due (None if none waits)."""
        now = now_iso()
        # The unfinished rows alone, by the index of them: without INDEXED BY the planner
        # took the index by status, or (before migration 19) the one of every row by chat
        # (a walk of every row ever sent) when the status term was hidden from it
        # (tests/test_history_paths.py).
        rows = self.db.query(
            """SELECT o.*, h.n AS unfinished FROM outbox o JOIN (
                   SELECT chat_jid, MIN(id) AS id, COUNT(*) AS n
                   FROM outbox INDEXED BY idx_outbox_open
                   WHERE status IN ('pending', 'sending') GROUP BY chat_jid) h ON o.id = h.id
               ORDER BY o.id""")
        due, later = [], ""
        for h, r in zip(outbox_rows(rows), rows, strict=True):
            if h.status != "pending" or h.waiting_for_copy or h.chat_jid in busy:
                continue
            if (h.next_attempt_at or "") <= now:
                due.append((h, int(r["unfinished"])))
            elif not later or (h.next_attempt_at or "") < later:
                later = h.next_attempt_at or ""
        due_in = None if not later else max(0.0, (from_iso(later) - utc_now()).total_seconds())
        return due, due_in

    def _head(self, jid: str) -> OutboxRow | None:
        """The chat's oldest unfinished row: a seek in idx_outbox_open, the index of open rows
        alone, so the rows a chat was sent before are never walked (tests/test_query_plans.py)."""
        r = self.db.query_one(
            "SELECT * FROM outbox WHERE chat_jid = ? AND status IN ('pending', 'sending') "
            "ORDER BY id LIMIT 1", (jid,))
        return None if r is None else outbox_row(r)

    async def run_once(self, per_chat: int | None = None) -> int:
        """Deliver every row that is due now (at most `per_chat` of each chat); return how
        many rows reached sent or failed."""
        heads, _ = self._due_heads()
        if not heads:
            return 0
        try:
            counts = await asyncio.gather(*(self._drain_chat(h, n, per_chat)
                                            for h, n in heads))
        finally:
            self._flush()
        return sum(counts)

    def _next_rows(self, jid: str, after: int, limit: int = 64) -> list[OutboxRow]:
        """The chat's next unfinished rows after id `after`, in order (a range seek in
        idx_outbox_open, the open rows by chat, then id: rows already sent are not walked)."""
        rows = self.db.query(
            "SELECT * FROM outbox WHERE chat_jid = ? AND id > ? AND status IN "
            "('pending', 'sending') ORDER BY id LIMIT ?", (jid, after, limit))
        return outbox_rows(rows)

    async def _drain_chat(self, head: OutboxRow, unfinished: int | None,
                          limit: int | None = None,
                          first: list[OutboxRow] | None = None) -> int:
        """Deliver the chat's rows in order, from `head` (its oldest unfinished row; the
        chat had `unfinished` such rows; None: unknown), until one is not due, waits or fails
        (or `limit` were delivered).

        Rows are claimed up to BATCH at a time. Claims and `sent` marks are not written one
        by one: the drains of all chats ask for them, and one transaction (_flush) writes
        what was asked for, behind the drains that asked in a turn of the event loop; the
        drain's first claim waits one turn for it, its next ones (a chat with more than
        BATCH rows due) are written at once with the marks of the batch it delivered, so a
        flood does not wait a turn (an IPC round) per BATCH rows. A delivered row is marked
        the next time this drain waits for anything (a send that waits on the network, the
        claim of its next batch, its end) and in the same turn of the loop, so a crash sends
        again at most the rows delivered since the drain last waited: at most BATCH per chat
        (MARKS_MAX in all), and only the row in flight when the chat service's send waits on
        the network. The drain holds a place among the chats sending at once while it has
        claimed rows to send, not while its claim is written. Claimed rows not yet tried go
        back to `pending` (their try not counted) when the drain stops early. `first`: rows
        written claimed already (hand_off), delivered first."""
        jid = head.chat_jid
        done = 0
        taken = len(first or ())
        # `sending`, not tried
        claimed: collections.deque[OutboxRow] = collections.deque(first or ())
        claims = 0  # claims this drain made
        wakes = self._wakes  # rows queued since are looked for before the drain ends
        sending = False  # holds a place among the chats sending at once (self._sem)
        after = head.id - 1
        ch = channel_for(self.channels, jid)
        try:
            while not self._stopping:
                if not claimed:
                    want = BATCH if limit is None else min(BATCH, limit - done)
                    if want <= 0:
                        return done
                    if unfinished is not None and taken >= unfinished:
                        if wakes == self._wakes:
                            # Every row the chat had was taken, and none was queued since
                            # (whatever queues one wakes the worker).
                            return done
                        # Rows were queued meanwhile (a burst): the drain goes on with
                        # them rather than end and be started again turns later.
                        unfinished = None
                    wakes = self._wakes
                    more = False
                    if unfinished == 1:
                        due = [head]
                    else:
                        due, more = self._due_rows(jid, after, want if unfinished is None
                                                   else min(want, unfinished - taken))
                    if not due:
                        return done
                    if ch is not None and not ch.is_connected():
                        # An outage delays messages, it does not use up their tries:
                        # look again soon.
                        self._defer(due[0], f"waiting: the {ch.name} channel is not "
                                    "connected")
                        return done
                    # A claim joins the other chats' (one transaction for all, a turn of
                    # the loop later); a drain with more rows due than this batch (a
                    # flood) writes its next claims at once, with the marks of the batch it
                    # delivered: it does not wait a turn (an IPC round) per BATCH rows.
                    claimed.extend(await self._claim(due, at_once=claims > 0 and more))
                    claims += 1
                    taken += len(due)
                    if not claimed:
                        return done
                    continue
                if not sending:
                    # A place among the chats sending at once is taken for sends, not for
                    # the wait for a claim: a chat waiting for its claim to be written does
                    # not hold back the others.
                    await self._sem.acquire()
                    sending = True
                    continue  # (stopping meanwhile?)
                row = claimed[0]
                if ch is not None and not ch.is_connected():
                    self._defer(row, f"waiting: the {ch.name} channel is not connected")
                    return done
                claimed.popleft()  # in flight: stays `sending` if this is cancelled
                # (Rows claimed behind it that a channel writing locally took with it, in
                # the same transaction: `with_it`.)
                finished, ok, with_it = await self._deliver(ch, row, claimed)
                if ok:
                    self._marks.append(row)
                    if len(self._marks) >= MARKS_MAX:
                        # Many chats delivered in one turn without a wait: their marks
                        # now, so what a crash would send again stays bounded in all.
                        self._flush_now()
                    else:
                        self._schedule_flush()
                elif not finished:
                    return done  # rescheduled: later rows of the chat wait behind it
                done += 1 + len(with_it)
                after = (with_it[-1] if with_it else row).id
                if limit is not None and done >= limit:
                    return done
                if not claimed and sending:
                    self._sem.release()
                    sending = False
        finally:
            if sending:
                self._sem.release()
            if claimed:
                self._releases.extend(claimed)
                self._schedule_flush()
            if self._active.get(jid) is asyncio.current_task():
                # Over now, not once its end is looked at (a turn later, maybe behind an IPC
                # round): the chat's next message can be handed over at once.
                del self._active[jid]
        return done

    def _due_rows(self, jid: str, after: int, limit: int) -> tuple[list[OutboxRow], bool]:
        """The chat's next rows after `after` that can go now: up to `limit`, stopping at
        the first that is not pending, waits for its copy or is not due; and whether more
        are due after them."""
        now = now_iso()
        due: list[OutboxRow] = []
        for row in self._next_rows(jid, after, limit + 1):
            if (row.status != "pending" or row.waiting_for_copy
                    or (row.next_attempt_at or "") > now):
                return due, False
            due.append(row)
        return due[:limit], len(due) > limit

    async def _claim(self, rows: list[OutboxRow], *, at_once: bool = False
                     ) -> list[OutboxRow]:
        """Mark `rows` (a chat's next due rows, in order) as being sent, a try counted for
        each: at once (`at_once`), or with what the other chats' drains ask for in this turn
        of the loop (the flush behind them, or the first of them to go on writes it). Returns
        the rows claimed: the leading ones that were still pending (in practice all)."""
        fut: asyncio.Future[list[OutboxRow]] = asyncio.get_running_loop().create_future()
        self._claims.append((rows, fut))
        if not at_once:
            self._schedule_flush()
            try:
                # One turn, not a wait on the future (whose callback would take a second
                # turn, each of which may be a whole IPC round during a burst).
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                if not fut.done():
                    fut.cancel()  # not written: nothing would send these rows
                elif not fut.cancelled() and fut.exception() is None:
                    self._releases.extend(fut.result())  # written: put back untried
                    self._schedule_flush()
                raise
        if not fut.done():
            self._flush()  # answers every claim asked for, this one included
        return fut.result()

    def _schedule_flush(self) -> None:
        if self._handing_off:
            return  # hand_off writes it as it ends, in this turn
        if self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_soon(self._queued_flush)

    def _flush_behind(self) -> None:
        """Queue the flush behind the first steps of the drains just started (not a turn
        later, behind whatever else the loop runs next, an IPC round say): what they ask for
        on their first step (a claim; a `sent` mark when the send did not wait) is written
        in the same turn, so a chat whose delivery is over has no row left `sending` when
        the next round looks (and its next message can be handed over too). A flush queued
        before them stays (moved, it could come a round later than it would have)."""
        if self._flush_at is None:
            self._schedule_flush()
        else:
            asyncio.get_running_loop().call_soon(self._flush_now)

    def _queued_flush(self) -> None:
        self._flush_at = None
        self._flush()

    def _flush(self) -> None:
        """Write the claims, `sent` marks and releases asked for since the last flush, in
        one transaction; then answer the claims and call `on_sent` for the rows marked.
        (A flush queued meanwhile stays queued: it writes what is asked for after this.)"""
        # A claim whose drain was cancelled meanwhile is not written: nothing would send
        # its rows, which would stay `sending` with a try counted until recover().
        claims = [(rows, fut) for rows, fut in self._claims if not fut.done()]
        self._claims = []
        marks, self._marks = self._marks, []
        releases, self._releases = self._releases, []
        if not (claims or marks or releases):
            return
        now = now_iso()
        got: list[list[OutboxRow]] = []
        try:
            with self.db.transaction() as c:
                if marks:
                    c.executemany(_SENT_SQL, [(now, now, r.id) for r in marks])
                    # Progress rows exist only for texts sent in parts: rows tried before
                    # (an earlier attempt may have left one) or split this time.
                    parts = [(r.id,) for r in marks if r.attempts or r.id in self._parted]
                    if parts:
                        c.executemany(_PROGRESS_SQL, parts)
                if releases:
                    c.executemany(_RELEASE_SQL, [(now, r.id) for r in releases])
                for rows, _ in claims:
                    ids = {r[0] for r in c.execute(_CLAIM_SQL, (
                        now, "[" + ",".join(str(r.id) for r in rows) + "]"))}
                    n = 0
                    while n < len(rows) and rows[n].id in ids:
                        n += 1
                    if n < len(ids):  # a gap: rows after it wait behind it, untried
                        c.executemany(_RELEASE_SQL,
                                      [(now, r.id) for r in rows[n:] if r.id in ids])
                    got.append(rows[:n])
        except Exception as e:
            # Nothing was written (a locked database, say): the marks and releases are
            # written by a flush a second from now (their chats wait behind their `sending`
            # rows, so no drain of theirs would ask for one); the claims fail their drains.
            self._marks[:0] = marks
            self._releases[:0] = releases
            if (marks or releases) and self._retry_flush is None:
                self._retry_flush = asyncio.get_running_loop().call_later(
                    1.0, self._flush_again)
            for _, fut in claims:
                if not fut.done():
                    fut.set_exception(e)
            if not claims:
                raise
            return
        for (_, fut), rows in zip(claims, got, strict=True):
            if not fut.done():
                fut.set_result(rows)
        for row in marks:
            self._marked(row, now)

    def _marked(self, row: OutboxRow, now: str, *, tried: int = 1) -> None:
        """`row`'s `sent` mark, written at `now`, has committed (`tried`: the tries the
        row as given lacks, the one just made)."""
        self._parted.discard(row.id)
        log.info("outbox: message %d sent to %s (try %d)", row.id, row.chat_jid,
                 row.attempts + tried)
        if self.on_sent is not None:
            # The row as written: no need to read it back.
            self._call(self.on_sent, dataclasses.replace(
                row, status="sent", attempts=row.attempts + tried, sent_at=now,
                updated_at=now, next_attempt_at=None))

    def _flush_now(self) -> None:
        """_flush, from a drain: a failure is logged (the flush a second later retries)."""
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - _flush asked for a further try
            log.exception("outbox: could not record deliveries; trying again shortly")

    def _flush_again(self) -> None:
        """The flush after one that failed; then a full look for due rows (the chats whose
        rows it put back or marked have no drain to go on)."""
        self._retry_flush = None
        try:
            self._flush()
        except Exception:  # noqa: BLE001 - _flush asked for a further try
            log.exception("outbox: could not record deliveries; trying again shortly")
            return
        self.wake()

    def _parts_sent(self, row_id: int) -> int:
        r = self.db.query_one("SELECT parts_sent FROM outbox_progress WHERE outbox_id = ?",
                              (row_id,))
        return int(r[0]) if r else 0

    def _set_parts_sent(self, row_id: int, n: int) -> None:
        self._parted.add(row_id)
        with self.db.transaction() as c:
            c.execute("INSERT INTO outbox_progress (outbox_id, parts_sent) VALUES (?, ?) "
                      "ON CONFLICT(outbox_id) DO UPDATE SET parts_sent = excluded.parts_sent",
                      (row_id, n))

    async def _send(self, ch: Channel, row: OutboxRow,
                    behind: collections.deque[OutboxRow] | None = None
                    ) -> list[OutboxRow] | None:
        """Send `row` through `ch`. None, or, for a text a channel that writes locally took
        (_deliver_locally), the rows it wrote and marked `sent`: `row` and those after it
        taken from `behind`."""
        if row.card is not None:
            await self._send_card(ch, row)
        elif row.kind == "text":
            if not (row.text or "").strip():
                raise ChannelError("the message is empty", permanent=True)
            parts = ch.message_parts(row.text or "")
            if ch.writes_locally and len(parts) == 1:
                return self._deliver_locally(ch, row, parts[0], behind)
            # Progress is recorded only during an attempt: a row never tried has none.
            start = self._parts_sent(row.id) if row.attempts else 0
            for i in range(start, len(parts)):
                with delivering(f"{row.id}.{i}"):
                    await ch.send_part(row.chat_jid, parts[i],
                                       reply_to=row.reply_to if i == 0 else None,
                                       sender=row.sender)
                if len(parts) > 1:
                    self._set_parts_sent(row.id, i + 1)
        elif row.kind == "file":
            if not row.file_path:
                raise ChannelError("the file row names no file", permanent=True)
            with delivering(f"{row.id}.file"):
                await ch.send_file(row.chat_jid, Path(row.file_path), file_name=row.file_name,
                                   caption=row.text)
        elif row.kind == "reaction":
            if not row.message_id or not row.emoji:
                raise ChannelError("the reaction names no message or emoji", permanent=True)
            await ch.react(row.chat_jid, row.message_id, row.emoji)
        else:
            raise ChannelError(f"unknown outbox kind {row.kind!r}", permanent=True)
        return None

    @staticmethod
    def _one_message(ch: Channel, text: str | None) -> str | None:
        """`text` as the one message it is for `ch`, or None if it is empty or more than
        one message."""
        if not (text or "").strip():
            return None
        parts = ch.message_parts(text or "")
        return parts[0] if len(parts) == 1 else None

    def _deliver_locally(self, ch: Channel, row: OutboxRow, text: str,
                       behind: collections.deque[OutboxRow] | None) -> list[OutboxRow]:
        """A text to a channel whose delivery is rows of this database (the local chat
        page), with the texts claimed after it (from the front of `behind`, in order):
        their rows and their `sent` marks in one transaction, so a crash can neither lose
        a reply nor, sending it again, show it twice; and one transaction for them all.
        Nothing is written if the channel refuses (ChannelError) or the database does (a
        failed try of `row`, as a chat service's error; the rows taken from `behind` go
        back to it, untried). Returns the rows written."""
        batch = [(row, text)]
        while behind and len(batch) < BATCH:
            nxt = behind[0]
            more = (self._one_message(ch, nxt.text)
                    if nxt.kind == "text" and nxt.card is None else None)
            if more is None:
                break
            batch.append((behind.popleft(), more))
        now = now_iso()
        try:
            with self.db.transaction() as c:
                committed = ch.write_texts(c, row.chat_jid, [
                    LocalText(t, r.reply_to, r.sender) for r, t in batch])
                c.executemany(_SENT_SQL, [(now, now, r.id) for r, _ in batch])
                parts = [(r.id,) for r, _ in batch if r.attempts or r.id in self._parted]
                if parts:
                    c.executemany(_PROGRESS_SQL, parts)
        except BaseException as e:
            if behind is not None:
                behind.extendleft(r for r, _ in reversed(batch[1:]))
            if isinstance(e, sqlite3.Error):
                raise ChannelError(f"the message could not be written: {e}") from None
            raise
        committed()
        for r, _ in batch:
            self._marked(r, now)
        return [r for r, _ in batch]

    async def _send_card(self, ch: Channel, row: OutboxRow) -> None:
        """A card row: a new card (the message it became is kept in the row's card, so a
        decision can edit it), or the edit of the card message `message_id`."""
        try:
            card = Card.from_json(row.card or "")
        except (ValueError, KeyError, TypeError):
            raise ChannelError("the card of this row is unreadable", permanent=True) from None
        with delivering(f"{row.id}.card"):
            if row.message_id:
                await ch.edit_card(row.chat_jid, row.message_id, card)
                return
            sent = await ch.send_card(row.chat_jid, card)
        if sent:
            with self.db.transaction() as c:
                c.execute("UPDATE outbox SET card = json_set(card, '$.sent', ?) WHERE id = ?",
                          (sent, row.id))

    async def _deliver(self, ch: Channel | None, row: OutboxRow,
                       behind: collections.deque[OutboxRow] | None = None
                       ) -> tuple[bool, bool, list[OutboxRow]]:
        """One attempt at `row` (claimed: `sending`, its try counted), through `ch` (the
        chat's channel; None if no channel serves it). Returns (True if it reached sent or
        failed, False if rescheduled; True if it was delivered, its `sent` mark still to be
        written: False for a text a channel that writes locally took, whose mark went with
        it; the rows claimed after it, taken from the front of `behind`, that such a
        channel took with it, delivered and marked too)."""
        attempt = row.attempts + 1
        try:
            if ch is None:
                raise ChannelError(f"no channel serves {row.chat_jid} (is its channel "
                                   "configured under channels:?)")
            marked = await self._send(ch, row, behind)
        except asyncio.CancelledError:
            raise  # stays `sending`; recover() puts it back
        except ChannelError as e:
            reason = ch.redact(str(e)) if ch else str(e)
            return self._count_failed(ch, self._failed_attempt(
                row, attempt, reason, e.permanent, e.retry_after)), False, []
        except Exception as e:  # noqa: BLE001 - a channel's bug is a failed attempt, not a crash
            # A channel bug: keep the type for the record; the text might hold anything
            # (a token, say), so neither it nor a traceback is logged.
            log.error("outbox: the %s channel raised %s for message %d",
                      ch.name if ch else "?", type(e).__name__, row.id)
            return self._count_failed(ch, self._failed_attempt(
                row, attempt, f"internal error in the {ch.name if ch else '?'} channel: "
                f"{type(e).__name__}", False, None)), False, []
        with_it = marked[1:] if marked is not None else []
        for r in (row, *with_it):
            metrics.outbox_attempts.get(ch.name, "sent").inc()
            with contextlib.suppress(ValueError):
                metrics.outbox_delivery.get(ch.name).observe(
                    (utc_now() - from_iso(r.created_at)).total_seconds())
        return True, marked is None, with_it

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
        if row is not None:
            self._call(cb, row)

    @staticmethod
    def _call(cb: RowCallback, row: OutboxRow) -> None:
        try:
            result = cb(row)
            if asyncio.iscoroutine(result):
                asyncio.ensure_future(result)
        except Exception:  # noqa: BLE001 - the owner's callback: the row is already final
            log.exception("outbox: result callback failed for message %d", row.id)


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


_SENT_SQL = ("UPDATE outbox SET status = 'sent', sent_at = ?, updated_at = ?, "
             "next_attempt_at = NULL WHERE id = ?")
# `+status`: look the ids up by rowid (without it SQLite walks every pending row of the
# status index and tests each against the list).
_CLAIM_SQL = ("UPDATE outbox SET status = 'sending', attempts = attempts + 1, updated_at = ? "
              "WHERE id IN (SELECT value FROM json_each(?)) AND +status = 'pending' "
              "RETURNING id")
_PROGRESS_SQL = "DELETE FROM outbox_progress WHERE outbox_id = ?"
_RELEASE_SQL = ("UPDATE outbox SET status = 'pending', attempts = attempts - 1, updated_at = ? "
                "WHERE id = ? AND status = 'sending'")


def get_row(db: Database, row_id: int) -> OutboxRow | None:
    r = db.query_one("SELECT * FROM outbox WHERE id = ?", (row_id,))
    return outbox_row(r) if r else None


def failed_since(db: Database, group_folder: str, since: str | None = None) -> list[OutboxRow]:
    """Rows of `group_folder` that became `failed` after `since` (ISO UTC; None: ever),
    oldest first: what the group's next agent run should be told did not arrive."""
    # The group's failed rows by the index of them (without INDEXED BY the planner may take
    # idx_outbox_status_time: every group's failed rows since, then a sort).
    rows = db.query(
        "SELECT * FROM outbox INDEXED BY idx_outbox_failed WHERE source_group = ? "
        "AND status = 'failed' AND updated_at > ? ORDER BY id", (group_folder, since or ""))
    return outbox_rows(rows)


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
