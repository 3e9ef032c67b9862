"""From a chat message to the agent's reply.

Inbound messages are stored once. A message is for the assistant when its group is main,
when the group does not require a trigger, or when it mentions the trigger; other messages
stay in the database as context and go into the next prompt. A group's `allow_senders`
narrows this (mdclaw.senders.decide, asked for every message): a message from anyone else
never starts a turn, and is either kept as context or not stored at all. If the group's
conversation container is running, triggered messages are written into its `input/` as
follow-ups; otherwise a run is queued. A run's prompt holds the messages since the group's
cursor. The cursor moves only when the run succeeded or its output was already delivered, so
a failed run is retried with the same messages and nothing is skipped.

A group past one of the disk limits (`mdclaw.diskguard`) gets no run: its chat is told once
what happened and what to do, and its messages wait (the cursor stays) until it is back
within the limit; a run the disk guard stopped is not retried.

Scheduled tasks run through the same queue (tasks first), with the group's session for
`context_mode: group` and a fresh one for `isolated`; their result goes to the task's chat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mdclaw.channels.base import Channel, InboundMessage, channel_for
from mdclaw.config import Config
from mdclaw.formatting import PromptMessage, format_prompt, mentions_trigger, strip_internal
from mdclaw.ipc.writers import write_follow_up
from mdclaw.outbox import describe_failures, failed_since
from mdclaw.paths import Layout
from mdclaw.queue import GroupQueue, Job
from mdclaw.runner import ContainerInput, ContainerResult, ContainerRunner
from mdclaw.senders import Decision, decide
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    get_session,
    messages_since,
    set_cursor,
    set_session,
    store_message,
)
from mdclaw.state.groups import (
    GroupRow,
    count_refusal,
    get_group,
    get_group_by_jid,
    list_groups,
)
from mdclaw.state.outbox import enqueue
from mdclaw.state.tasks import TaskRow

log = logging.getLogger("mdclaw.orchestrator")

MAX_PROMPT_MESSAGES = 50
# A message in a chat that is not a registered group: stored (main's agent sees the chat in
# its list of available groups), never run.
_UNREGISTERED = Decision(store=True, direct=False, run=False, refused=False)
# Agent errors that mean the stored session cannot be resumed: start fresh next time.
SESSION_GONE_HINTS = ("no conversation found", "session not found", "session is gone",
                      "unknown session", "invalid session")


class RunFailed(RuntimeError):
    """A container run ended without a usable result; the queue retries it."""


class RunRefused(RunFailed):
    """The disk rule refuses runs of this group for now (see mdclaw.diskguard); retrying at
    once cannot help, so the queue does not."""

    permanent = True

    def __init__(self, verdict: Any) -> None:
        super().__init__(verdict.summary())
        self.verdict = verdict


@dataclass
class _Conversation:
    """What the orchestrator tracks about a group's run in progress."""

    start_cursor: str | None
    last_ts: str | None
    delivered: bool = False
    scheduled: bool = False
    sent_ids: set[str] = field(default_factory=set)


class Orchestrator:
    """Glue between channels, the queue, the container runner and the outbox.

    `runner` may be None while the container engine is unreachable: jobs then fail (and are
    retried by the queue) with a clear reason.
    """

    def __init__(self, cfg: Config, db: Database, *, runner: ContainerRunner | None,
                 proxy: Any = None, channels: list[Channel] | None = None,
                 wake_outbox: Callable[[], None] = lambda: None,
                 max_concurrent: int | None = None, diskguard: Any = None) -> None:
        self.cfg = cfg
        self.db = db
        self.layout = Layout(cfg.data_dir)
        self.runner = runner
        self.proxy = proxy
        self.channels = channels or []
        self.wake_outbox = wake_outbox
        # mdclaw.diskguard.DiskGuard: runs of a group past a disk limit are refused.
        self.diskguard = diskguard
        self.queue = GroupQueue(self.run_job,
                                max_concurrent=max_concurrent
                                or cfg.limits.max_concurrent_containers,
                                max_attempts=cfg.limits.run_attempts,
                                retry_base=cfg.limits.run_retry_base.total_seconds(),
                                on_failure=self.on_job_failed)
        self._conv: dict[str, _Conversation] = {}
        self._task_waiters: dict[str, asyncio.Future[Any]] = {}
        self.accepting = True
        # Set once the engine answered and orphans of an earlier run were removed; until
        # then runs wait (a container started earlier would be taken for an orphan).
        self.engine_ready = asyncio.Event()
        self.engine_wait = 60.0
        self.stopping = asyncio.Event()
        # Host-side timings of the latest runs (milliseconds), for benchmarks and status.
        self.timings: list[dict[str, float]] = []
        # (group, sender) pairs whose refusal was logged at info level: once each, so the
        # admin can find ids for allow_senders without a busy chat flooding the log.
        self._refusals_logged: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------ inbound
    @staticmethod
    def _for_assistant(group: GroupRow, msg: InboundMessage | StoredMessage) -> bool:
        """True if the group's trigger rules (not its allow-list) make `msg` a request."""
        if group.is_main or not group.requires_trigger:
            return True
        if getattr(msg, "addressed", False):
            return True
        return mentions_trigger(msg.content, group.trigger)

    def decision(self, group: GroupRow | None,
                 msg: InboundMessage | StoredMessage) -> Decision:
        """What to do with `msg` in `group` (None: a chat that is no registered group)."""
        if group is None:
            return _UNREGISTERED
        return decide(group.allow_senders, msg.sender,
                      triggered=self._for_assistant(group, msg))

    def is_triggered(self, group: GroupRow, msg: InboundMessage | StoredMessage) -> bool:
        """True if `msg` starts a turn of `group`'s agent (or joins the running one)."""
        return self.decision(group, msg).run

    async def on_inbound(self, msg: InboundMessage) -> None:
        """Store `msg` once (unless its group drops it); run or feed its group's agent when
        the message is for it; count it when the group's allow_senders refused it."""
        t0 = time.perf_counter()
        group = get_group_by_jid(self.db, msg.chat_jid)
        decision = self.decision(group, msg)
        if decision.store:
            stored = StoredMessage(msg.id, msg.chat_jid, msg.sender, msg.sender_name,
                                   msg.content, msg.timestamp, False, False)
            if not await asyncio.to_thread(
                    store_message, self.db, stored, chat_name=msg.chat_name,
                    channel=msg.channel or msg.chat_jid.split(":", 1)[0],
                    is_group=msg.is_group):
                return  # a duplicate delivery
        if group is None:
            return
        if decision.refused:
            await asyncio.to_thread(count_refusal, self.db, group.folder)
            self._log_refusal(group, msg, decision)
        if not self.accepting:
            return
        if not decision.run:
            log.debug("group %s: message %s kept as context (no trigger or not an allowed "
                      "sender)", group.folder, msg.id)
            return
        self.dispatch(group, t_inbound=t0)

    def _log_refusal(self, group: GroupRow, msg: InboundMessage, decision: Decision) -> None:
        key = (group.folder, msg.sender)
        level = logging.DEBUG if key in self._refusals_logged else logging.INFO
        self._refusals_logged.add(key)
        log.log(level, "group %s: sender %r (%s) is not in allow_senders; message %s %s",
                group.folder, msg.sender, msg.sender_name, msg.id,
                "kept as context" if decision.store else "dropped")

    def dispatch(self, group: GroupRow, *, t_inbound: float | None = None) -> None:
        """Feed the group's running conversation, or queue a run for it."""
        handle = self.runner.active(group.folder) if self.runner else None
        conv = self._conv.get(group.folder)
        if handle is not None and not handle.closed and conv is not None and not conv.scheduled:
            self._feed(group, handle, conv)
            return
        self.queue.enqueue_message(group.folder, payload={"t_inbound": t_inbound},
                                   job_id=f"msg:{group.folder}")

    def _feed(self, group: GroupRow, handle: Any, conv: _Conversation) -> None:
        """Write every message since the last one the conversation saw into input/.

        Each follow-up is a turn of the agent, so only messages of allowed senders become
        one; messages of others (allow_senders mode trigger) ride along as context in the
        next allowed sender's follow-up, or wait for the next prompt if none comes.
        """
        assert group.jid is not None
        pending = [m for m in messages_since(self.db, group.jid, conv.last_ts)
                   if m.id not in conv.sent_ids]
        context: list[StoredMessage] = []
        fed = 0
        for m in pending:
            if not self.decision(group, m).direct:
                context.append(m)
                continue
            content = m.content if not context else self._prompt(context + [m])
            write_follow_up(self.layout, group.folder, sender=m.sender,
                            sender_name=m.sender_name, content=content, timestamp=m.timestamp)
            conv.sent_ids.update(c.id for c in context)
            conv.sent_ids.add(m.id)
            conv.last_ts = m.timestamp
            context = []
            fed += 1
        if fed:
            handle.touch()
            log.info("group %s: %d follow-up message(s) into the running conversation",
                     group.folder, fed)

    def _prompt(self, msgs: list[StoredMessage], failed: tuple[str, ...] = ()) -> str:
        """`msgs` as the agent reads them: sender, local time and text of each."""
        return format_prompt([PromptMessage(m.sender_name, m.content, m.timestamp)
                              for m in msgs], self.cfg.assistant.timezone,
                             max_messages=MAX_PROMPT_MESSAGES, failed=failed)

    def recover_pending(self) -> int:
        """Queue a run for every group with triggered messages its agent has not seen yet
        (a crash, a stop or a failed run left them); return how many groups."""
        n = 0
        for group in list_groups(self.db):
            if not group.jid:
                continue
            pending = messages_since(self.db, group.jid, get_cursor(self.db, group.folder))
            if any(self.is_triggered(group, m) for m in pending):
                self.dispatch(group)
                n += 1
        if n:
            log.info("queued %d group(s) with messages not yet answered", n)
        return n

    # ------------------------------------------------------------------ tasks
    async def execute_task(self, task: TaskRow) -> Any:
        """The scheduler's executor: run `task` through the queue; return its result text.

        Raises RunFailed when the run failed after the queue's retries.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self.queue.enqueue_task(task.group_folder, task.id, payload={"task": task,
                                                                            "future": fut}):
            raise RunFailed(f"task {task.id} is already queued or running")
        self._task_waiters[task.id] = fut
        try:
            return await fut
        finally:
            self._task_waiters.pop(task.id, None)

    # ------------------------------------------------------------------ jobs
    async def run_job(self, job: Job) -> Any:
        if job.kind == "task":
            payload = job.payload
            result = await self._run_task(payload["task"])
            fut = payload["future"]
            if not fut.done():
                fut.set_result(result)
            return result
        return await self._run_messages(job)

    async def on_job_failed(self, job: Job, error: BaseException) -> None:
        """The queue gave up on `job`: tell the scheduler, or tell the chat."""
        if job.kind == "task":
            fut = job.payload["future"]
            if not fut.done():
                fut.set_exception(RunFailed(str(error)))
            return
        group = get_group(self.db, job.group)
        if group and group.jid:
            self._send_text(group.jid, group.folder,
                            f"Sorry, I could not answer: {error}. I tried "
                            f"{self.queue.max_attempts} times; send your message again to retry.")

    def _send_text(self, jid: str, folder: str, text: str) -> None:
        with self.db.transaction() as c:
            enqueue(c, chat_jid=jid, kind="text", text=text, source_group=folder)
        self.wake_outbox()

    def _container_input(self, group: GroupRow, prompt: str, *, session: str | None,
                         scheduled: bool, fields: dict[str, Any]) -> ContainerInput:
        assert group.jid is not None
        return ContainerInput(prompt=prompt, group_folder=group.folder, chat_jid=group.jid,
                              is_main=group.is_main, is_scheduled_task=scheduled,
                              assistant_name=self.cfg.assistant.name, session_id=session,
                              **fields)

    async def _run_container(self, group: GroupRow, make_input: Callable[[dict[str, Any]],
                             ContainerInput], on_output: Callable[[str], Any]) -> ContainerResult:
        if self.diskguard is not None:
            verdict = await self.diskguard.admit(group.folder)
            if not verdict.ok:
                raise RunRefused(verdict)
        if self.runner is None:
            raise RunFailed("the container engine is not reachable")
        if not self.engine_ready.is_set():
            ready = asyncio.ensure_future(self.engine_ready.wait())
            stopping = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait([ready, stopping], timeout=self.engine_wait,
                               return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            stopping.cancel()
            if not self.engine_ready.is_set():
                raise RunFailed("the container engine is not reachable"
                                + (" and mdclaw is stopping" if self.stopping.is_set() else ""))
        timeout = (group.container_config.get("timeout_ms") or 0) / 1000 or None
        if self.proxy is not None:
            async with self.proxy.for_run(self.cfg, group.folder) as fields:
                return await self.runner.run(group.folder, make_input(fields),
                                             on_output=on_output, timeout=timeout)
        return await self.runner.run(group.folder, make_input({}), on_output=on_output,
                                     timeout=timeout)

    def _handle_block(self, group: GroupRow, block: str, reply_jid: str) -> tuple[bool, str]:
        """Act on one output block; return (delivered something, result text)."""
        try:
            out = json.loads(block)
        except json.JSONDecodeError:
            log.warning("group %s: output block is not JSON; ignored", group.folder)
            return False, ""
        if not isinstance(out, dict):
            return False, ""
        session = out.get("newSessionId")
        error = str(out.get("error") or "")
        if out.get("status") == "error" and any(h in error.lower() for h in SESSION_GONE_HINTS):
            log.info("group %s: session is gone; the next run starts fresh", group.folder)
            set_session(self.db, group.folder, None)
        elif isinstance(session, str) and session:
            set_session(self.db, group.folder, session)
        text = strip_internal(str(out.get("result") or ""))
        if out.get("status") == "error":
            log.warning("group %s: agent reported an error: %s", group.folder, error[:500])
        if text:
            self._send_text(reply_jid, group.folder, text)
            return True, text
        return False, text

    async def _set_typing(self, jid: str, on: bool) -> None:
        ch = channel_for(self.channels, jid)
        if ch is None:
            return
        with contextlib.suppress(Exception):
            await ch.set_typing(jid, on)

    async def _run_messages(self, job: Job) -> None:
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        start_cursor = get_cursor(self.db, group.folder)
        msgs = messages_since(self.db, group.jid, start_cursor, limit=MAX_PROMPT_MESSAGES * 4)
        if not msgs or not any(self.is_triggered(group, m) for m in msgs):
            return
        failures = describe_failures(failed_since(self.db, group.folder, self._told(group)))
        prompt = self._prompt(msgs, tuple(failures.splitlines()) if failures else ())
        conv = _Conversation(start_cursor=start_cursor, last_ts=msgs[-1].timestamp,
                             sent_ids={m.id for m in msgs})
        self._conv[group.folder] = conv
        session = get_session(self.db, group.folder)
        t_inbound = (job.payload or {}).get("t_inbound")
        marks = {"picked": time.perf_counter()}

        def on_output(block: str) -> None:
            delivered, _ = self._handle_block(group, block, group.jid or "")
            if delivered:
                conv.delivered = True
                marks.setdefault("first_output", time.perf_counter())
                # Output reached the outbox: the messages it answered are done.
                set_cursor(self.db, group.folder, conv.last_ts or "")

        await self._set_typing(group.jid, True)
        try:
            result = await self._run_container(
                group, lambda f: self._container_input(group, prompt, session=session,
                                                       scheduled=False, fields=f), on_output)
        except RunRefused as e:
            self._refused(group, e.verdict)  # the messages wait for the next allowed run
            return
        finally:
            self._conv.pop(group.folder, None)
            await self._set_typing(group.jid, False)
        self._mark_told(group)
        self._record_timing(result, marks, t_inbound)
        stopped = (self.diskguard.blocked(group.folder)
                   if self.diskguard is not None and result.status != "success" else None)
        if stopped is not None:
            self._refused(group, stopped)  # the disk rule stopped it: say so, no retries
        if result.status == "success" or conv.delivered:
            set_cursor(self.db, group.folder, conv.last_ts or "")
            # Messages that arrived after the prompt was built but could not be fed in.
            later = messages_since(self.db, group.jid, conv.last_ts)
            if any(self.is_triggered(group, m) for m in later):
                self.queue.enqueue_message(group.folder, job_id=f"msg:{group.folder}:next")
            return
        # Roll back: the same messages go into the retry.
        if start_cursor is None:
            with self.db.transaction() as c:
                c.execute("DELETE FROM router_state WHERE key = ?",
                          (f"last_agent_timestamp:{group.folder}",))
        else:
            set_cursor(self.db, group.folder, start_cursor)
        if stopped is not None:
            return
        raise RunFailed(result.error or f"the agent container ended with status {result.status}"
                        f" (exit code {result.exit_code})")

    def _refused(self, group: GroupRow, verdict: Any) -> None:
        """Tell the group's chat why it gets no answer, once while the condition lasts."""
        log.warning("group %s: run refused: %s", group.folder, verdict.summary())
        text = self.diskguard.notice(group.folder, verdict) if self.diskguard else None
        if text and group.jid:
            self._send_text(group.jid, group.folder, text)

    def _told(self, group: GroupRow) -> str | None:
        r = self.db.query_one("SELECT value FROM router_state WHERE key = ?",
                              (f"failures_told:{group.folder}",))
        return r[0] if r else None

    def _mark_told(self, group: GroupRow) -> None:
        with self.db.transaction() as c:
            c.execute("INSERT INTO router_state (key, value) VALUES (?, ?) ON CONFLICT(key) "
                      "DO UPDATE SET value = excluded.value",
                      (f"failures_told:{group.folder}", now_iso()))

    async def _run_task(self, task: TaskRow) -> str:
        group = get_group(self.db, task.group_folder)
        if group is None or group.jid is None:
            raise RunFailed(f"task {task.id}: group {task.group_folder!r} is not registered")
        session = get_session(self.db, group.folder) if task.context_mode == "group" else None
        texts: list[str] = []
        self._conv[group.folder] = _Conversation(None, None, scheduled=True)

        def on_output(block: str) -> None:
            _, text = self._handle_block(group, block, task.chat_jid)
            if text:
                texts.append(text)
            # A scheduled run is single-turn: close it once it answered.
            handle = self.runner.active(group.folder) if self.runner else None
            if handle is not None:
                handle.close()

        try:
            result = await self._run_container(
                group, lambda f: self._container_input(group, task.prompt, session=session,
                                                       scheduled=True, fields=f), on_output)
        except RunRefused as e:
            self._refused(group, e.verdict)
            raise
        finally:
            self._conv.pop(group.folder, None)
        stopped = (self.diskguard.blocked(group.folder)
                   if self.diskguard is not None and result.status != "success" else None)
        if stopped is not None:
            self._refused(group, stopped)
            raise RunRefused(stopped)
        if result.status != "success" and not texts:
            raise RunFailed(result.error or f"the agent container ended with status "
                            f"{result.status} (exit code {result.exit_code})")
        return "\n\n".join(texts)

    def _record_timing(self, result: ContainerResult, marks: dict[str, float],
                       t_inbound: float | None) -> None:
        m = result.marks
        entry: dict[str, float] = {}
        if t_inbound is not None and "start_call" in m:
            entry["inbound_to_start_call_ms"] = (m["start_call"] - t_inbound) * 1000
        if "picked" in marks and "start_call" in m:
            entry["pick_to_start_call_ms"] = (m["start_call"] - marks["picked"]) * 1000
        if entry:
            self.timings = (self.timings + [entry])[-100:]

    # ------------------------------------------------------------------ shutdown
    def abandon(self, jobs: list[Job]) -> None:
        """Jobs the queue dropped at shutdown: their scheduled runs end with that reason."""
        for job in jobs:
            if job.kind == "task":
                fut = job.payload["future"]
                if not fut.done():
                    fut.set_exception(RunFailed("mdclaw stopped before the task could run"))

    def close_conversations(self) -> int:
        """Stop waiting for the engine; write `_close` to every running conversation;
        return how many were asked to finish."""
        self.stopping.set()
        if self.runner is None:
            return 0
        n = 0
        for folder in list(self.queue.running_groups()):
            handle = self.runner.active(folder)
            if handle is not None and not handle.closed:
                handle.close()
                n += 1
        return n
