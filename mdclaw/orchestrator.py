"""From a chat message to the agent's reply.

Inbound messages are stored once. A message is for the assistant when its group is main,
when the group does not require a trigger, or when it mentions the trigger; other messages
stay in the database as context and go into the next prompt. A group's `allow_senders`
narrows this (mdclaw.senders.decide, asked for every message): a message from anyone else
never starts a turn, and is either kept as context or not stored at all. If the group's
conversation container is running, triggered messages are written into its `input/` as
follow-ups; otherwise a run is queued. A run's prompt holds the messages since the group's
cursor. The cursor moves past messages once their turn was answered.

A failed turn is handled by its cause (mdclaw/failures.py): a transient cause (the model
server is down, the container was killed...) rolls the cursor back so the same messages are
retried with backoff, and the chat is told once that a retry is coming; a deterministic cause
(the model refused the message, it is too long...) or a configuration error (no model, the
backend is not in the image...) is not retried: the messages are marked failed, the cursor
moves past them so the next message gets a normal answer, and the chat is told why at once.
This holds in an open conversation too: a follow-up that fails is told at once.

A group past one of the disk limits (`mdclaw.diskguard`) gets no run: its chat is told once
what happened and what to do, and its messages wait (the cursor stays) until it is back
within the limit; a run the disk guard stopped is not retried.

Scheduled tasks run through the same queue (tasks first), with the group's session for
`context_mode: group` and a fresh one for `isolated`; their result goes to the task's chat.
A task that comes due while its group's conversation container runs does not wait for the
idle timer: an idle conversation (every turn answered) is closed at once, a busy one as soon
as its turn's answer is out (no follow-up is fed into it meanwhile); the task then runs in
the group's one container. The run log says when the task started and what it waited for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mdclaw import failures, media
from mdclaw.channels.base import Channel, ChannelError, InboundMessage, channel_for
from mdclaw.config import Config, format_duration, read_secret
from mdclaw.errors import EngineError
from mdclaw.failures import CONFIG, TRANSIENT, TurnFailure
from mdclaw.formatting import PromptMessage, format_prompt, mentions_trigger, strip_internal
from mdclaw.ipc.writers import write_follow_up
from mdclaw.outbox import describe_failures, failed_since
from mdclaw.paths import Layout
from mdclaw.proxy import DEFAULT_BASE_URLS, model_for_group
from mdclaw.queue import GroupQueue, Job
from mdclaw.runner import ContainerInput, ContainerResult, ContainerRunner
from mdclaw.runtime import engine_errors
from mdclaw.schedule import utc_now
from mdclaw.senders import Decision, decide
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    get_session,
    messages_since,
    pending_files,
    set_cursor,
    set_session,
    settle_files,
    store_message,
)
from mdclaw.state.failed_turns import mark_messages_failed, record_failed_turn
from mdclaw.state.groups import (
    GroupRow,
    count_refusal,
    get_group,
    get_group_by_jid,
    list_groups,
)
from mdclaw.state.outbox import enqueue
from mdclaw.state.tasks import TaskRow, mark_run_started
from mdclaw.transcribe import Transcriber, make_transcriber
from mdclaw.wire import OutputBlock

log = logging.getLogger("mdclaw.orchestrator")

MAX_PROMPT_MESSAGES = 50
MAX_PARALLEL_DOWNLOADS = 4  # files of inbound messages fetched at once
# A message in a chat that is not a registered group: stored (main's agent sees the chat in
# its list of available groups), never run.
_UNREGISTERED = Decision(store=True, direct=False, run=False, refused=False)
# Agent errors that mean the stored session cannot be resumed: start fresh next time.
SESSION_GONE_HINTS = ("no conversation found", "session not found", "session is gone",
                      "unknown session", "invalid session")


IMAGE_CHECK_TTL = 30.0  # seconds an image's backends label is trusted before asking again


class RunFailed(EngineError, RuntimeError):
    """A container run ended without a usable result. With a transient `failure` the queue
    retries it (after at least `retry_delay` seconds, at most `max_tries` tries in all);
    otherwise it is final (`permanent`)."""

    def __init__(self, message: str, failure: TurnFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.permanent = failure is not None and failure.policy != TRANSIENT
        self.retry_delay = failure.retry_after if failure is not None else None
        self.max_tries = (failures.rule(failure.cause).max_tries
                          if failure is not None else None)


class RunRefused(RunFailed):
    """The disk rule refuses runs of this group for now (see mdclaw.diskguard); retrying at
    once cannot help, so the queue does not."""

    permanent = True

    def __init__(self, verdict: Any) -> None:
        super().__init__(verdict.summary())
        self.verdict = verdict
        self.permanent = True


@dataclass
class _Conversation:
    """What the orchestrator tracks about a group's run in progress."""

    start_cursor: str | None
    last_ts: str | None  # the newest message the agent was given
    delivered: bool = False
    scheduled: bool = False
    sent_ids: set[str] = field(default_factory=set)
    answered_ts: str | None = None  # the cursor after the latest answered (or settled) turn
    pending: TurnFailure | None = None  # a transient failure no later turn has answered
    pending_upto: str | None = None  # the newest message given to the agent when it failed
    turns_open: int = 0  # prompts and follow-ups given to the agent, not yet answered
    yield_to_task: bool = False  # a task is due: close once no turn is open, feed no more

    @property
    def busy(self) -> bool:
        """The agent is working on a turn (an answer block has not come yet)."""
        return self.turns_open > 0


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
                                on_failure=self.on_job_failed, on_retry=self.on_job_retry)
        self._conv: dict[str, _Conversation] = {}
        self._task_waiters: dict[str, asyncio.Future[Any]] = {}
        self.accepting = True
        # Set once the engine answered and orphans of an earlier run were removed; until
        # then runs wait (a container started earlier would be taken for an orphan).
        self.engine_ready = asyncio.Event()
        self.engine_wait = 60.0
        # A first try waits this long at most for the engine, so the chat hears at once when
        # it is down; retries wait up to engine_wait.
        self.engine_first_wait = 4.0
        self.stopping = asyncio.Event()
        # Host-side timings of the latest runs (milliseconds), for benchmarks and status.
        self.timings: list[dict[str, float]] = []
        # (group, sender) pairs whose refusal was logged at info level: once each, so the
        # admin can find ids for allow_senders without a busy chat flooding the log.
        self._refusals_logged: set[tuple[str, str]] = set()
        # image ref -> (time.monotonic(), backends label or None, present)
        self._image_checks: dict[str, tuple[float, tuple[str, ...] | None, bool]] = {}
        # Voice notes to text (transcription: in config); None when not configured.
        self.transcriber: Transcriber | None = make_transcriber(cfg.transcription)
        # Messages whose files are being downloaded (message id -> its task), and how many
        # downloads may run at once.
        self._file_tasks: dict[str, asyncio.Task[None]] = {}
        self._chat_files: dict[str, asyncio.Task[None]] = {}  # chat -> its newest such task
        self._downloads = asyncio.Semaphore(MAX_PARALLEL_DOWNLOADS)

    # ------------------------------------------------------------------ inbound
    @staticmethod
    def _for_assistant(group: GroupRow, msg: InboundMessage | StoredMessage) -> bool:
        """True if the group's trigger rules (not its allow-list) make `msg` a request."""
        if group.is_main or not group.requires_trigger:
            return True
        if getattr(msg, "addressed", False):
            return True
        return mentions_trigger(msg.content, group.trigger) or any(
            mentions_trigger(str(f.get("transcript") or ""), group.trigger)
            for f in getattr(msg, "attachments", ()) if isinstance(f, dict))

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
        the message is for it; count it when the group's allow_senders refused it.

        A message with files returns once it is stored: its files are downloaded and saved
        by a task of their own (`_take_files`), so a big download never holds up the channel
        that handed the message over (nor other chats). Until the files are settled the
        message, and every later one of its chat, is held back from the agent
        (mdclaw.state.conversations), so the agent reads the chat in order."""
        t0 = time.perf_counter()
        group = get_group_by_jid(self.db, msg.chat_jid)
        decision = self.decision(group, msg)
        if decision.store:
            fetch = bool(msg.attachments) and group is not None
            files = (media.announced(msg.attachments) if fetch else
                     [s.as_dict() for s in media.not_saved_note(
                         msg.attachments, "this chat is no registered group")])
            stored = StoredMessage(msg.id, msg.chat_jid, msg.sender, msg.sender_name,
                                   msg.content, msg.timestamp, False, False,
                                   attachments=tuple(files), files_pending=fetch)
            if not await asyncio.to_thread(
                    store_message, self.db, stored, chat_name=msg.chat_name,
                    channel=msg.channel or msg.chat_jid.split(":", 1)[0],
                    is_group=msg.is_group):
                return  # a duplicate delivery (its files were fetched the first time)
            if fetch:
                assert group is not None
                # One message's files after the other within a chat (their names in the
                # inbox and their release follow the chat's order); chats in parallel.
                before = self._chat_files.get(msg.chat_jid)
                task = asyncio.create_task(self._take_files(group, msg, t0, before),
                                           name=f"files:{msg.id}")
                self._file_tasks[msg.id] = task
                self._chat_files[msg.chat_jid] = task
                task.add_done_callback(self._file_task_done)
                return
        await self._after_stored(group, msg, decision, t0)

    def _file_task_done(self, task: asyncio.Task[None]) -> None:
        for mid, t in list(self._file_tasks.items()):
            if t is task:
                del self._file_tasks[mid]
        for jid, t in list(self._chat_files.items()):
            if t is task:
                del self._chat_files[jid]

    async def _after_stored(self, group: GroupRow | None, msg: InboundMessage | StoredMessage,
                            decision: Decision, t0: float) -> None:
        if group is None:
            log.info("message %s in %s: stored (no group answers in this chat)", msg.id,
                     msg.chat_jid)
            return
        if decision.refused:
            await asyncio.to_thread(count_refusal, self.db, group.folder)
            self._log_refusal(group, msg, decision)
        if not self.accepting:
            log.info("message %s in %s: stored (mdclaw is stopping)", msg.id, msg.chat_jid)
            return
        log.info("group %s: message %s in (%d characters)", group.folder, msg.id,
                 len(msg.content))
        if not decision.run:
            log.debug("group %s: message %s kept as context (no trigger or not an allowed "
                      "sender)", group.folder, msg.id)
            return
        self.dispatch(group, t_inbound=t0)

    async def _take_files(self, group: GroupRow, msg: InboundMessage, t0: float,
                          before: asyncio.Task[None] | None = None) -> None:
        """Save `msg`'s files in its group's inbox (mdclaw.media), record what became of them
        with the message and release it to the agent. Files that could not be kept are named
        with the reason, and the chat is told."""
        if before is not None:
            await asyncio.wait([before])
        try:
            async with self._downloads:
                saved = await media.save_all(self.cfg, group.folder, msg.attachments,
                                             transcriber=self.transcriber)
        except Exception:  # noqa: BLE001 - never leave the chat held back
            log.exception("group %s: saving the files of message %s failed", group.folder,
                          msg.id)
            saved = media.not_saved_note(msg.attachments, "saving it failed (see the log)")
        lost = [s for s in saved if s.container_path is None]
        if lost and group.jid:
            self._send_text(group.jid, group.folder, "\n".join(
                f"I could not keep {s.name!r}: {s.error}" for s in lost))
        files = tuple(s.as_dict() for s in saved)
        await asyncio.to_thread(settle_files, self.db, msg.id, files)
        stored = StoredMessage(msg.id, msg.chat_jid, msg.sender, msg.sender_name, msg.content,
                               msg.timestamp, False, False, attachments=files)
        decision = self.decision(group, stored)  # a transcript may name the trigger
        await self._after_stored(group, stored, decision, t0)
        if not decision.run and self.accepting:
            self._release_held(group)

    def _release_held(self, group: GroupRow) -> None:
        """Run the agent for triggered messages of `group`'s chat that waited behind a
        message's files (their own dispatch found them held back)."""
        if group.jid is None:
            return
        conv = self._conv.get(group.folder)
        after = conv.last_ts if conv is not None else get_cursor(self.db, group.folder)
        if any(self.is_triggered(group, m) for m in messages_since(self.db, group.jid, after)):
            self.dispatch(group)

    async def files_settled(self) -> None:
        """Wait until every file download under way has been settled (tests, shutdown)."""
        while self._file_tasks:
            await asyncio.gather(*list(self._file_tasks.values()), return_exceptions=True)

    def settle_stale_files(self) -> int:
        """Messages whose files were being downloaded when mdclaw stopped: record that the
        files were not saved (the agent is told, the chat too) and release them."""
        n = 0
        for m in pending_files(self.db):
            if m.id in self._file_tasks:
                continue
            group = get_group_by_jid(self.db, m.chat_jid)
            files = tuple({**{k: v for k, v in f.items() if k != "path"},
                           "error": "mdclaw stopped before it was saved; please send it again"}
                          for f in m.attachments)
            settle_files(self.db, m.id, files)
            if group is not None and group.jid:
                self._send_text(group.jid, group.folder, "\n".join(
                    f"I could not keep {f.get('name')!r}: mdclaw stopped before it was "
                    "saved; please send it again" for f in files))
            n += 1
        if n:
            log.warning("%d message(s) whose files were downloading when mdclaw stopped: "
                        "their files are lost, the chats were told", n)
        return n

    def _log_refusal(self, group: GroupRow, msg: InboundMessage | StoredMessage,
                     decision: Decision) -> None:
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
        if (handle is not None and not handle.closed and conv is not None
                and not conv.scheduled and not conv.yield_to_task):
            self._feed(group, handle, conv)
            return
        self.queue.enqueue_message(group.folder, payload={"t_inbound": t_inbound},
                                   job_id=f"msg:{group.folder}")

    def _enqueue_next(self, group: GroupRow, after: str | None) -> None:
        """Queue a run when triggered messages newer than `after` are waiting."""
        assert group.jid is not None
        later = messages_since(self.db, group.jid, after)
        if any(self.is_triggered(group, m) for m in later):
            self.queue.enqueue_message(group.folder, payload={},
                                       job_id=f"msg:{group.folder}:next")

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
            # Always the prompt's form: the person's text escaped, files as elements it
            # cannot imitate (mdclaw.formatting).
            content = self._prompt(context + [m])
            write_follow_up(self.layout, group.folder, sender=m.sender,
                            sender_name=m.sender_name, content=content, timestamp=m.timestamp)
            conv.sent_ids.update(c.id for c in context)
            conv.sent_ids.add(m.id)
            conv.last_ts = m.timestamp
            context = []
            fed += 1
        if fed:
            conv.turns_open += fed
            handle.touch()
            log.info("group %s: %d follow-up message(s) into the running conversation",
                     group.folder, fed)

    def _prompt(self, msgs: list[StoredMessage], failed: tuple[str, ...] = ()) -> str:
        """`msgs` as the agent reads them: sender, local time and text of each."""
        return format_prompt([PromptMessage(m.sender_name, m.content, m.timestamp,
                                            m.attachments) for m in msgs],
                             self.cfg.assistant.timezone,
                             max_messages=MAX_PROMPT_MESSAGES, failed=failed)

    def recover_pending(self) -> int:
        """Queue a run for every group with triggered messages its agent has not seen yet
        (a crash, a stop or a failed run left them); return how many groups."""
        self.settle_stale_files()
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
        payload = {"task": task, "future": fut, "queued_at": time.perf_counter()}
        if not self.queue.enqueue_task(task.group_folder, task.id, payload=payload):
            raise RunFailed(f"task {task.id} is already queued or running")
        payload["waits_for"] = self._make_way(task)
        self._task_waiters[task.id] = fut
        try:
            return await fut
        finally:
            self._task_waiters.pop(task.id, None)

    def _make_way(self, task: TaskRow) -> str | None:
        """`task` was just queued: free its group's container for it. Returns what it waits
        for (None: nothing, it starts now; else a phrase for the run log).

        One container per group: an idle conversation is closed at once (nothing is lost;
        the next message starts a new container with the same session), a busy one as soon
        as its turn is answered; a running task is single-turn and ends by itself.
        """
        folder = task.group_folder
        ahead = [j.id for j in self.queue.pending(folder) if j.kind == "task" and j.id != task.id]
        after = f" and for task(s) {', '.join(ahead)} queued before it" if ahead else ""
        job = self.queue.running_job(folder)
        if job is not None and job.kind == "task":
            if job.id == task.id:
                return None  # picked at once
            return f"for task {job.id} to finish{after}"
        if job is None:
            if ahead:
                return after.removeprefix(" and ")
            if self.queue.running_count < self.queue.max_concurrent:
                return None
            freed = self._close_idle_elsewhere(folder)
            if freed:
                return f"for group {freed}'s idle conversation, closed to free a container slot"
            return "for a free container slot (limits.max_concurrent_containers)"
        conv = self._conv.get(folder)
        if conv is None or conv.scheduled:
            return f"for the group's current run to finish{after}"
        conv.yield_to_task = True
        if conv.busy:
            log.info("group %s: task %s is due; the conversation ends after its turn",
                     folder, task.id)
            return f"for the conversation's turn to finish{after}"
        handle = self.runner.active(folder) if self.runner else None
        if handle is not None:
            log.info("group %s: task %s is due; closing the idle conversation", folder, task.id)
            handle.close()
        return f"for the idle conversation, closed for it, to end{after}"

    def _close_idle_elsewhere(self, folder: str) -> str | None:
        """Every container slot is taken: close the conversation idle longest (of another
        group) so a due task of `folder` gets its slot. Returns that group, or None."""
        best: tuple[float, str] | None = None
        for other in self.queue.running_groups():
            conv = self._conv.get(other)
            handle = self.runner.active(other) if self.runner else None
            if (other == folder or conv is None or conv.scheduled or conv.busy
                    or handle is None or handle.closed):
                continue
            if best is None or handle.last_activity < best[0]:
                best = (handle.last_activity, other)
        if best is None:
            return None
        conv = self._conv[best[1]]
        conv.yield_to_task = True
        log.info("group %s: closing its idle conversation so a due task of %s can start",
                 best[1], folder)
        handle = self.runner.active(best[1]) if self.runner else None
        if handle is not None:
            handle.close()
        return best[1]

    def _task_starting(self, task: TaskRow, payload: dict[str, Any]) -> None:
        """Record in the run log that `task` is handed to the container runner now, and what
        it waited for (when it waited at all)."""
        waited = time.perf_counter() - payload.get("queued_at", time.perf_counter())
        why = payload.get("waits_for")
        note = f"waited {waited:.1f} s {why}" if why else None
        if note:
            log.info("task %s: %s", task.id, note)
        try:
            mark_run_started(self.db, task.id, utc_now(), note)
        except Exception:  # noqa: BLE001 - the log line is bookkeeping; the run goes on
            log.exception("task %s: could not record its start", task.id)

    # ------------------------------------------------------------------ jobs
    async def run_job(self, job: Job) -> Any:
        if job.kind == "task":
            payload = job.payload
            result = await self._run_task(payload["task"], payload)
            fut = payload["future"]
            if not fut.done():
                fut.set_result(result)
            return result
        return await self._run_messages(job)

    async def on_job_failed(self, job: Job, error: BaseException) -> None:
        """The queue gave up on `job`: tell the scheduler, or settle the messages' failure
        and tell the chat."""
        failure = getattr(error, "failure", None) or TurnFailure(
            "agent_crash", detail=f"{type(error).__name__}: {error}")
        if job.kind == "task":
            fut = job.payload["future"]
            if not fut.done():
                fut.set_exception(error if isinstance(error, RunFailed)
                                  else RunFailed(str(error), failure))
            return
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        if self.stopping.is_set() or not self.accepting:
            # Stopping: the messages stay unanswered and are run at the next start.
            return
        payload = job.payload if isinstance(job.payload, dict) else {}
        after = get_cursor(self.db, group.folder)
        upto = payload.get("upto")
        if upto is None:
            newest = messages_since(self.db, group.jid, after)
            upto = newest[-1].timestamp if newest else None
        if upto is None:
            return
        outcome = "gave_up" if failure.policy == TRANSIENT else (
            "config" if failure.policy == CONFIG else "dropped")
        self._settle(group, failure, after=after, upto=upto, outcome=outcome,
                     attempts=max(1, job.attempts))
        self._enqueue_next(group, upto)

    async def on_job_retry(self, job: Job, error: BaseException, delay: float) -> None:
        """A message run failed for a transient cause and is retried in `delay` seconds: say
        so once (again only when the cause changes)."""
        if job.kind != "message":
            return
        failure = getattr(error, "failure", None) or TurnFailure(
            "agent_crash", detail=f"{type(error).__name__}: {error}")
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        if not isinstance(job.payload, dict):
            job.payload = {}
        told = job.payload.get("told_cause")
        text = None
        if told != failure.cause:
            text = failures.chat_message(failure, self._failure_ctx(group), outcome="retry",
                                         delay=delay)
            job.payload["told_cause"] = failure.cause
        payload = job.payload
        with self.db.transaction() as c:
            record_failed_turn(c, group_folder=group.folder, chat_jid=group.jid,
                               cause=failure.cause, policy=failure.policy, outcome="retry",
                               attempts=job.attempts, detail=failure.detail,
                               last_message_at=payload.get("upto"), told=text)
            if text:
                enqueue(c, chat_jid=group.jid, kind="text", text=text, source_group=group.folder)
        if text:
            self.wake_outbox()
        log.warning("group %s: turn failed (%s, try %d): %s; retrying in %.0f s", group.folder,
                    failure.cause, job.attempts, failure.detail or "-", delay)

    def _send_text(self, jid: str, folder: str, text: str) -> None:
        with self.db.transaction() as c:
            enqueue(c, chat_jid=jid, kind="text", text=text, source_group=folder)
        self.wake_outbox()

    # ------------------------------------------------------------------ failures
    def _failure_ctx(self, group: GroupRow) -> dict[str, Any]:
        """What a failure's chat message may name: the model server (host and port), the
        memory limit, the image, the backend, the model's config key, the time limit."""
        key, spec = model_for_group(self.cfg, group.folder)
        backend = spec.backend if spec else "claude"
        timeout_ms = group.container_config.get("timeout_ms") or 0
        cfg_group = self.cfg.groups.get(group.folder)
        hard = (timeout_ms / 1000 if timeout_ms else
                (cfg_group.timeout if cfg_group and cfg_group.timeout
                 else self.cfg.limits.container_timeout).total_seconds())
        return {"base_url": (spec.base_url if spec else None) or DEFAULT_BASE_URLS[backend],
                "memory": self.cfg.limits.memory, "image": self.cfg.runtime.image,
                "backend": backend, "model_key": key or "-",
                "limit": format_duration(timedelta(seconds=hard))}

    def _settle(self, group: GroupRow, failure: TurnFailure, *, after: str | None,
                upto: str, outcome: str, attempts: int = 1) -> None:
        """A turn failed for good: mark its messages (newer than `after`, up to `upto`)
        failed, move the cursor past them, record the failure and tell the chat once."""
        assert group.jid is not None
        text = failures.chat_message(failure, self._failure_ctx(group), outcome=outcome,
                                     attempts=attempts)
        with self.db.transaction() as c:
            n, first = mark_messages_failed(c, group.jid, after, upto, failure.cause)
            set_cursor(self.db, group.folder, upto)
            record_failed_turn(c, group_folder=group.folder, chat_jid=group.jid,
                               cause=failure.cause, policy=failure.policy, outcome=outcome,
                               attempts=attempts, detail=failure.detail,
                               first_message_at=first, last_message_at=upto, messages=n,
                               told=text)
            enqueue(c, chat_jid=group.jid, kind="text", text=text, source_group=group.folder)
        self.wake_outbox()
        log.warning("group %s: turn failed (%s, %s after %d tr%s); %d message(s) set aside: %s",
                    group.folder, failure.cause, outcome, attempts,
                    "y" if attempts == 1 else "ies", n, failure.detail or "-")

    def _refine(self, group: GroupRow, failure: TurnFailure) -> TurnFailure:
        """Name the cause better with what the credential proxy saw on the host's side (a
        backend that reports only text, or a run that ended without a structured error)."""
        if failure.cause != "agent_crash" or self.proxy is None:
            return failure
        seen = getattr(self.proxy, "recent_failure", lambda _f: None)(group.folder)
        if seen:
            return TurnFailure(seen, detail=failure.detail, exit_code=failure.exit_code)
        return failure

    async def _precheck_config(self, group: GroupRow) -> TurnFailure | None:
        """Configuration errors found before anything is started (the engine is not needed):
        no model resolves for the group, or its key file cannot be read."""
        if self.proxy is None:
            return None  # no model path at all (tests, benchmarks)
        key, spec = model_for_group(self.cfg, group.folder)
        if spec is None:
            return TurnFailure("no_model", detail="no model resolves for the group: no "
                               "models entry, or several and no assistant.model")
        if spec.api_key_file is not None:
            try:
                ok = bool(await asyncio.to_thread(read_secret, spec.api_key_file))
            except OSError as e:
                ok = False
                why = e.strerror or type(e).__name__
            else:
                why = "empty"
            if not ok:
                return TurnFailure("key_missing", detail=f"models.{key}.api_key_file: {why}")
        return None

    async def _precheck_image(self, group: GroupRow) -> TurnFailure | None:
        """The image is missing, or its mdclaw.backends label lacks the group's backend."""
        if self.proxy is None or self.runner is None:
            return None
        _key, spec = model_for_group(self.cfg, group.folder)
        if spec is None:
            return None
        backends, present = await self._image_check(self.cfg.runtime.image)
        if not present:
            return TurnFailure("image_missing", detail=f"{self.cfg.runtime.image} not found")
        if backends is not None and spec.backend not in backends:
            return TurnFailure("backend_missing", detail=f"image {self.cfg.runtime.image} "
                               f"carries {','.join(backends) or 'no backend'}")
        return None

    async def _image_check(self, image: str) -> tuple[tuple[str, ...] | None, bool]:
        """(backends label, present) of `image`, asked at most every IMAGE_CHECK_TTL s; an
        engine that does not answer counts as present (the run then says what is wrong)."""
        now = time.monotonic()
        got = self._image_checks.get(image)
        if got is not None and now - got[0] < IMAGE_CHECK_TTL:
            return got[1], got[2]
        assert self.runner is not None
        try:
            info = await asyncio.to_thread(self.runner.runtime.image_info, image)
        except engine_errors():  # the engine will be asked again by the run, which says why
            log.debug("could not look at image %s", image, exc_info=True)
            return None, True
        result = (info.backends if info is not None else None, info is not None)
        if info is not None:  # a missing image is looked for again next time
            self._image_checks[image] = (now, *result)
        return result

    # ------------------------------------------------------------------ runs
    def _container_input(self, group: GroupRow, prompt: str, *, session: str | None,
                         scheduled: bool, fields: dict[str, Any]) -> ContainerInput:
        assert group.jid is not None
        return ContainerInput(prompt=prompt, group_folder=group.folder, chat_jid=group.jid,
                              is_main=group.is_main, is_scheduled_task=scheduled,
                              assistant_name=self.cfg.assistant.name, session_id=session,
                              **fields)

    async def _run_container(self, group: GroupRow, make_input: Callable[[dict[str, Any]],
                             ContainerInput], on_output: Callable[[str], Any], *,
                             first_try: bool = False,
                             on_start: Callable[[], None] | None = None) -> ContainerResult:
        """Start the group's container and wait for it. Raises RunFailed with the failure
        when it cannot run (configuration, engine, image, proxy)."""
        pre = await self._precheck_config(group)
        if pre is not None:
            raise RunFailed(pre.detail or pre.cause, pre)
        if self.diskguard is not None:
            verdict = await self.diskguard.admit(group.folder)
            if not verdict.ok:
                raise RunRefused(verdict)
        if self.runner is None:
            raise RunFailed("the container engine is not reachable",
                            TurnFailure("engine_down", detail="no container engine configured "
                                        "or found"))
        if not self.engine_ready.is_set():
            ready = asyncio.ensure_future(self.engine_ready.wait())
            stopping = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait([ready, stopping], timeout=min(self.engine_wait,
                                                              self.engine_first_wait)
                               if first_try else self.engine_wait,
                               return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            stopping.cancel()
            if not self.engine_ready.is_set():
                raise RunFailed("the container engine is not reachable",
                                TurnFailure("engine_down", detail="the engine did not answer"
                                            + (" and mdclaw is stopping"
                                               if self.stopping.is_set() else "")))
        pre = await self._precheck_image(group)
        if pre is not None:
            raise RunFailed(pre.detail or pre.cause, pre)
        timeout = (group.container_config.get("timeout_ms") or 0) / 1000 or None
        if on_start is not None:
            on_start()
        try:
            if self.proxy is not None:
                async with self.proxy.for_run(self.cfg, group.folder) as fields:
                    return await self.runner.run(group.folder, make_input(fields),
                                                 on_output=on_output, timeout=timeout)
            return await self.runner.run(group.folder, make_input({}), on_output=on_output,
                                         timeout=timeout)
        except (RunFailed, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the engine, the image, the proxy
            failure = failures.from_exception(e)
            if failure.cause == "image_missing":
                self._image_checks.pop(self.cfg.runtime.image, None)
            raise RunFailed(str(e), failure) from e

    def _parse_block(self, group: GroupRow, block: str) -> OutputBlock | None:
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
            set_session(self.db, group.folder, None)
        elif out.new_session_id:
            set_session(self.db, group.folder, out.new_session_id)
        return out

    def _deliver(self, group: GroupRow, out: OutputBlock, reply_jid: str) -> str:
        """Send a success block's notice and text to `reply_jid`; return the text."""
        if out.notice is not None and out.notice.cause == "context_too_long":
            self._send_text(reply_jid, group.folder, failures.trimmed_notice(out.notice.limit))
        text = strip_internal(out.result or "")
        if text:
            self._send_text(reply_jid, group.folder, text)
            log.info("group %s: reply out to %s (%d characters)", group.folder, reply_jid,
                     len(text))
        return text

    def _handle_block(self, group: GroupRow, block: str, reply_jid: str) -> tuple[bool, str]:
        """Act on one output block; return (delivered something, result text)."""
        out = self._parse_block(group, block)
        if out is None:
            return False, ""
        if out.status == "error":
            log.warning("group %s: agent reported an error (%s): %s", group.folder,
                        out.cause or out.ignored.get("cause") or "no cause",
                        (out.error or "")[:500])
            return False, ""
        text = self._deliver(group, out, reply_jid)
        return bool(text), text

    async def _set_typing(self, jid: str, on: bool) -> None:
        """Show or hide the typing indicator in `jid`'s chat. Never raises: it is cosmetic."""
        ch = channel_for(self.channels, jid)
        if ch is None:
            return
        try:
            await ch.set_typing(jid, on)
        except ChannelError as e:  # the chat service is away: the answer still goes out
            log.debug("typing indicator in %s: %s", jid, ch.redact(str(e)))
        except Exception:  # noqa: BLE001 - a channel's bug must not fail a run over this
            log.warning("the %s channel failed to set typing in %s", ch.name, jid,
                        exc_info=True)

    def _turn_failed(self, group: GroupRow, conv: _Conversation, failure: TurnFailure) -> None:
        """A turn failed while the container runs (an error block)."""
        handle = self.runner.active(group.folder) if self.runner else None
        if failure.policy == TRANSIENT:
            # End the conversation: the run's end rolls the cursor back and the queue retries
            # the unanswered messages with backoff (telling the chat once).
            conv.pending = failure
            conv.pending_upto = conv.last_ts
            if handle is not None:
                handle.close()
            return
        if conv.last_ts is not None and conv.last_ts != conv.answered_ts:
            self._settle(group, failure, after=conv.answered_ts, upto=conv.last_ts,
                         outcome="config" if failure.policy == CONFIG else "dropped")
            conv.answered_ts = conv.last_ts
        conv.pending = None
        if failure.policy == CONFIG and handle is not None:
            handle.close()  # every later turn would fail the same way

    async def _run_messages(self, job: Job) -> None:
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        if not isinstance(job.payload, dict):
            job.payload = {}
        start_cursor = get_cursor(self.db, group.folder)
        msgs = messages_since(self.db, group.jid, start_cursor, limit=MAX_PROMPT_MESSAGES * 4)
        if not msgs or not any(self.is_triggered(group, m) for m in msgs):
            return
        failed_deliveries = describe_failures(failed_since(self.db, group.folder,
                                                          self._told(group)))
        prompt = self._prompt(msgs, tuple(failed_deliveries.splitlines())
                              if failed_deliveries else ())
        conv = _Conversation(start_cursor=start_cursor, last_ts=msgs[-1].timestamp,
                             sent_ids={m.id for m in msgs}, answered_ts=start_cursor,
                             turns_open=1)
        job.payload["upto"] = conv.last_ts
        self._conv[group.folder] = conv
        session = get_session(self.db, group.folder)
        t_inbound = job.payload.get("t_inbound")
        marks = {"picked": time.perf_counter()}

        def on_output(block: str) -> None:
            conv.turns_open = max(0, conv.turns_open - 1)
            try:
                answer(block)
            finally:
                if conv.yield_to_task and not conv.busy:
                    # A task is due: the turn is answered, so the conversation ends now.
                    handle = self.runner.active(group.folder) if self.runner else None
                    if handle is not None and not handle.closed:
                        log.info("group %s: turn answered; closing the conversation for a "
                                 "due task", group.folder)
                        handle.close()

        def answer(block: str) -> None:
            out = self._parse_block(group, block)
            if out is None:
                return
            if out.status == "error":
                failure = self._refine(group, TurnFailure.from_block(out))
                log.warning("group %s: turn failed in the container (%s): %s", group.folder,
                            failure.cause, failure.detail or "-")
                self._turn_failed(group, conv, failure)
                return
            if conv.pending is not None and conv.pending_upto:
                # A later message (already in the container) was answered after a turn
                # failed for a transient cause: that turn cannot be retried on its own now.
                self._settle(group, conv.pending, after=conv.answered_ts,
                             upto=conv.pending_upto, outcome="resend")
            if self._deliver(group, out, group.jid or ""):
                conv.delivered = True
                marks.setdefault("first_output", time.perf_counter())
            # This turn is answered: the messages it had are done.
            conv.pending = None
            conv.answered_ts = conv.last_ts
            set_cursor(self.db, group.folder, conv.last_ts or "")

        await self._set_typing(group.jid, True)
        try:
            result = await self._run_container(
                group, lambda f: self._container_input(group, prompt, session=session,
                                                       scheduled=False, fields=f), on_output,
                first_try=job.attempts == 0)
        except RunRefused as e:
            self._conv.pop(group.folder, None)
            await self._set_typing(group.jid, False)
            self._refused(group, e.verdict)  # the messages wait for the next allowed run
            return
        except RunFailed as e:
            self._conv.pop(group.folder, None)
            await self._set_typing(group.jid, False)
            if e.failure is not None and e.failure.policy != TRANSIENT:
                # Nothing ran: settle at once (config errors, a missing image).
                self._settle(group, e.failure, after=start_cursor, upto=conv.last_ts or "",
                             outcome="config" if e.failure.policy == CONFIG else "dropped")
                self._enqueue_next(group, conv.last_ts)
                return
            raise
        finally:
            self._conv.pop(group.folder, None)
        await self._set_typing(group.jid, False)
        self._mark_told(group)
        self._record_timing(result, marks, t_inbound)
        stopped = (self.diskguard.blocked(group.folder)
                   if self.diskguard is not None and result.status != "success" else None)
        if stopped is not None:
            # The disk rule stopped it: say so; what was not answered waits, no retries.
            self._refused(group, stopped)
            self._roll_back(group, conv)
            return
        failure = conv.pending
        unanswered = conv.last_ts != conv.answered_ts
        if failure is None and result.status != "success" and unanswered:
            failure = self._refine(group, failures.from_result(result))
            log.warning("group %s: the run ended without an answer (%s): %s", group.folder,
                        failure.cause, failure.detail or "-")
        job.payload["upto"] = conv.last_ts
        if failure is None:
            set_cursor(self.db, group.folder, conv.last_ts or "")
            # Messages that arrived after the prompt was built but could not be fed in.
            self._enqueue_next(group, conv.last_ts)
            return
        if failure.policy != TRANSIENT:
            self._settle(group, failure, after=conv.answered_ts, upto=conv.last_ts or "",
                         outcome="config" if failure.policy == CONFIG else "dropped")
            self._enqueue_next(group, conv.last_ts)
            return
        # Transient: roll back to the latest answered turn; the queue retries the rest.
        if conv.answered_ts != start_cursor:
            # This run answered something first: the failure is about later messages, so
            # its tries (and what the chat was told) start afresh.
            job.attempts = 0
            job.payload.pop("told_cause", None)
        self._roll_back(group, conv)
        raise RunFailed(failure.detail or failure.cause, failure)

    def _roll_back(self, group: GroupRow, conv: _Conversation) -> None:
        """Put the group's cursor back to the latest answered turn of this run (or to none),
        so what was not answered is in the next prompt."""
        if conv.answered_ts is None:
            with self.db.transaction() as c:
                c.execute("DELETE FROM router_state WHERE key = ?",
                          (f"last_agent_timestamp:{group.folder}",))
        else:
            set_cursor(self.db, group.folder, conv.answered_ts)

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

    async def _run_task(self, task: TaskRow, payload: dict[str, Any] | None = None) -> str:
        group = get_group(self.db, task.group_folder)
        if group is None or group.jid is None:
            raise RunFailed(f"task {task.id}: group {task.group_folder!r} is not registered")
        session = get_session(self.db, group.folder) if task.context_mode == "group" else None
        texts: list[str] = []
        errors: list[TurnFailure] = []
        self._conv[group.folder] = _Conversation(None, None, scheduled=True)

        def on_output(block: str) -> None:
            out = self._parse_block(group, block)
            if out is not None and out.status == "error":
                errors.append(self._refine(group, TurnFailure.from_block(out)))
            elif out is not None:
                text = self._deliver(group, out, task.chat_jid)
                if text:
                    texts.append(text)
            # A scheduled run is single-turn: close it once it answered.
            handle = self.runner.active(group.folder) if self.runner else None
            if handle is not None:
                handle.close()

        try:
            result = await self._run_container(
                group, lambda f: self._container_input(group, task.prompt, session=session,
                                                       scheduled=True, fields=f), on_output,
                on_start=lambda: self._task_starting(task, payload or {}))
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
        if result.status != "success" and not texts or errors and not texts:
            failure = errors[-1] if errors else self._refine(group,
                                                             failures.from_result(result))
            text = failures.describe(failure, self._failure_ctx(group))
            raise RunFailed(f"{text} ({failure.cause}: {failure.detail or '-'})", failure)
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
