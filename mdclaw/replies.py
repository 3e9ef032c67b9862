"""What a run's output and its outcome write back: the agent's replies to the chat, the session
an answer carries, and, when a turn fails, the record of it and the chat's notice.

Everything goes out through the outbox (a row in the same transaction as the change it
reports, then `wake_outbox`), never to a channel directly:

* `parse_block` reads one output block of the agent and keeps the session id it names (or
  forgets the stored one when the agent says it is gone);
* `deliver` sends a success block's text (and, first, the notice that the conversation's
  oldest context was trimmed);
* `settle` sets a failed turn's messages aside (mdclaw.turns.Settle): they are marked failed,
  the cursor moves past them, the failure is recorded in `failed_turns` and the chat is told
  why, in plain words (mdclaw/failures.py), all in one transaction;
* `retrying` records a transient failure the queue retries, and tells the chat when asked
  to (once per cause, mdclaw.turns.tell_retry);
* `refused` tells the chat, once while it lasts, that the disk rule refused or stopped its
  group's run.

`failure_context` is what those words may name of the config: the model server, the memory
limit, the image, the backend, the model's config key, the time limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mdclaw import failures
from mdclaw.config import Config, format_duration
from mdclaw.failures import TurnFailure
from mdclaw.formatting import strip_internal
from mdclaw.models import DEFAULT_BASE_URLS, model_for_group
from mdclaw.preflight import DiskRule, DiskVerdict
from mdclaw.state import Database
from mdclaw.state.conversations import move_cursor, set_session
from mdclaw.state.failed_turns import (
    Marked,
    mark_messages_failed,
    message_time,
    record_failed_turn,
)
from mdclaw.state.groups import GroupRow
from mdclaw.state.outbox import enqueue
from mdclaw.turns import Settle
from mdclaw.wire import OutputBlock

# Logged under the name these lines had before they moved here, so that journal filters
# and log readers keep working.
log = logging.getLogger("mdclaw.orchestrator")

# Agent errors that mean the stored session cannot be resumed: start fresh next time.
SESSION_GONE_HINTS = ("no conversation found", "session not found", "session is gone",
                      "unknown session", "invalid session")


def failure_context(cfg: Config, group: GroupRow) -> dict[str, Any]:
    """What a failure's chat message may name: the model server (host and port), the
    memory limit, the image, the backend, the model's config key, the time limit."""
    key, spec = model_for_group(cfg, group.folder)
    backend = spec.backend if spec else "claude"
    timeout_ms = group.container_config.get("timeout_ms") or 0
    cfg_group = cfg.groups.get(group.folder)
    hard = (timeout_ms / 1000 if timeout_ms else
            (cfg_group.timeout if cfg_group and cfg_group.timeout
             else cfg.limits.container_timeout).total_seconds())
    return {"base_url": (spec.base_url if spec else None) or DEFAULT_BASE_URLS[backend],
            "memory": cfg.limits.memory, "image": cfg.runtime.image,
            "backend": backend, "model_key": key or "-",
            "limit": format_duration(timedelta(seconds=hard))}


class Replies:
    """Writes what runs produce (see the module's notes). `config` is asked each time (a
    reload may change it); `wake_outbox` is called after every row it queues."""

    def __init__(self, db: Database, *, config: Callable[[], Config],
                 wake_outbox: Callable[[], None], diskguard: DiskRule | None = None) -> None:
        self.db = db
        self._config = config
        self._wake_outbox = wake_outbox
        self.diskguard = diskguard

    def send_text(self, jid: str, folder: str, text: str) -> None:
        with self.db.transaction() as c:
            enqueue(c, chat_jid=jid, kind="text", text=text, source_group=folder)
        self._wake_outbox()

    def parse_block(self, group: GroupRow, block: str,
                    line: str | None = None) -> OutputBlock | None:
        """The block read through the wire contract (mdclaw.wire), with the session id kept
        (or dropped when it is gone)."""
        out = OutputBlock.read(block)
        if out is None:
            log.warning("group %s: output block is not a JSON object; ignored", group.folder)
            return None
        if out.ignored:
            log.debug("group %s: output block fields not read: %s", group.folder,
                      ", ".join(sorted(out.ignored)))
        error = out.error or ""
        if out.status == "error" and any(h in error.lower() for h in SESSION_GONE_HINTS):
            log.info("group %s: session is gone; the next run starts fresh", group.folder)
            set_session(self.db, group.folder, None, line)
        elif out.new_session_id:
            set_session(self.db, group.folder, out.new_session_id, line)
        return out

    def deliver(self, group: GroupRow, out: OutputBlock, reply_jid: str) -> str:
        """Send a success block's notice and text to `reply_jid`; return the text."""
        if out.notice is not None and out.notice.cause == "context_too_long":
            self.send_text(reply_jid, group.folder, failures.trimmed_notice(out.notice.limit))
        text = strip_internal(out.result or "")
        if text:
            self.send_text(reply_jid, group.folder, text)
            log.info("group %s: reply out to %s (%d characters)", group.folder, reply_jid,
                     len(text))
        return text

    def settle(self, group: GroupRow, settle: Settle, *, attempts: int = 1,
               line: str | None = None, reply: str | None = None) -> None:
        """A turn failed for good: mark its messages (newer than `settle.after`, up to
        `settle.upto`) failed, move the cursor past them, record the failure and tell the
        chat once. `line`: the chat of a per_chat conversation (None: the group's);
        `reply`: the chat told (default: the group's first)."""
        chats = group.line(line)
        assert chats
        reply = reply or chats[0]
        failure, upto, outcome = settle.failure, settle.upto, settle.outcome
        text = failures.chat_message(failure, failure_context(self._config(), group),
                                     outcome=outcome, attempts=attempts)
        with self.db.transaction() as c:
            parts = [mark_messages_failed(c, chat, settle.after, upto, failure.cause)
                     for chat in chats]
            marked = _joined(parts)
            move_cursor(self.db, group.folder, upto, line)
            record_failed_turn(c, group_folder=group.folder, chat_jid=reply,
                               cause=failure.cause, policy=failure.policy, outcome=outcome,
                               attempts=attempts, detail=failure.detail,
                               first_message_at=marked.first_at, last_message_at=marked.last_at,
                               messages=marked.messages, told=text,
                               first_message_seq=marked.first_seq, last_message_seq=upto)
            enqueue(c, chat_jid=reply, kind="text", text=text, source_group=group.folder)
        self._wake_outbox()
        log.warning("group %s: turn failed (%s, %s after %d tr%s); %d message(s) set aside: %s",
                    group.folder, failure.cause, outcome, attempts,
                    "y" if attempts == 1 else "ies", marked.messages, failure.detail or "-")

    def retrying(self, group: GroupRow, failure: TurnFailure, *, attempts: int,
                 upto: int | None, delay: float, tell: bool, reply: str | None = None) -> None:
        """A message run failed for a transient cause and is retried in `delay` seconds:
        record it, and tell the chat (`reply`, default the group's first) when `tell`."""
        reply = reply or group.jid
        assert reply is not None
        text = None
        if tell:
            text = failures.chat_message(failure, failure_context(self._config(), group),
                                         outcome="retry", delay=delay)
        with self.db.transaction() as c:
            record_failed_turn(c, group_folder=group.folder, chat_jid=reply,
                               cause=failure.cause, policy=failure.policy, outcome="retry",
                               attempts=attempts, detail=failure.detail,
                               last_message_at=message_time(c, upto), last_message_seq=upto,
                               told=text)
            if text:
                enqueue(c, chat_jid=reply, kind="text", text=text, source_group=group.folder)
        if text:
            self._wake_outbox()
        log.warning("group %s: turn failed (%s, try %d): %s; retrying in %.0f s", group.folder,
                    failure.cause, attempts, failure.detail or "-", delay)

    def refused(self, group: GroupRow, verdict: DiskVerdict, reply: str | None = None) -> None:
        """Tell the group's chat why it gets no answer (the disk rule refused or stopped its
        run), once while the condition lasts."""
        log.warning("group %s: run refused: %s", group.folder, verdict.summary())
        text = self.diskguard.notice(group.folder, verdict) if self.diskguard else None
        reply = reply or group.jid
        if text and reply:
            self.send_text(reply, group.folder, text)


def _joined(parts: list[Marked]) -> Marked:
    """The messages of several chats set aside by one turn, as one."""
    if len(parts) == 1:
        return parts[0]
    firsts = [p for p in parts if p.messages]
    first = min(firsts, key=lambda p: p.first_seq or 0) if firsts else None
    lasts = [p.last_at for p in firsts if p.last_at]
    return Marked(sum(p.messages for p in parts), first.first_seq if first else None,
                  first.first_at if first else None, max(lasts) if lasts else None)
