"""From a chat message to the agent's reply.

Inbound messages are stored once. A message is for the assistant when its group does not
require a trigger, or when it addresses the assistant (mdclaw.formatting.addresses: "@Andy"
anywhere, "Andy," at the start, a reply to the assistant, the service's own mention of the
bot); other messages stay in the database as context and go into the next prompt. Who may
drive the agent narrows this, asked for every message: a group's `members` (people and
roles, mdclaw.people; strangers by `unknown_senders`), else its `allow_senders`
(mdclaw.senders.decide): a message from anyone else never starts a turn, and is either kept
as context or not stored at all. Notes the host puts into a conversation (an approval's
outcome) are context only; a person's answer to a card ("approve 7KQ2") is no message at
all (mdclaw.decisions). If the group's conversation container is running, triggered
messages are written into its `input/` as follow-ups; otherwise a run is queued. A run's
prompt holds the messages since the group's cursor. The cursor moves past messages once
their turn was answered. Files that come with a message are fetched by
mdclaw.media.FileIntake, off the channel's path.

A failed turn is handled by its cause (mdclaw/failures.py): a transient cause (the model
server is down, the container was killed...) rolls the cursor back so the same messages are
retried with backoff, and the chat is told once that a retry is coming; a deterministic cause
(the model refused the message, it is too long...) or a configuration error (no model, the
backend is not in the image...) is not retried: the messages are marked failed, the cursor
moves past them so the next message gets a normal answer, and the chat is told why at once.
This holds in an open conversation too: a follow-up that fails is told at once. These turn
rules are mdclaw.turns (plain state, tested on its own); this module asks them, does the
I/O and tells them what happened. Configuration errors a run would meet are found before it
starts (mdclaw.preflight), so the chat hears them at once.

A group past one of the disk limits (`mdclaw.diskguard`) gets no run: its chat is told once
what happened and what to do, and its messages wait (the cursor stays) until it is back
within the limit; a run the disk guard stopped is not retried.

Scheduled tasks run through the same queue (tasks first) and the same container, one per
group (mdclaw.taskruns: a due task makes the group's conversation end early). Every run is
started by mdclaw.launch; what its output and outcome write (replies, failed turns, the
chat's notices) is mdclaw.replies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mdclaw import failures, people
from mdclaw.agentasks import AgentAsks
from mdclaw.channels.base import Channel, ChannelError, InboundMessage, channel_for
from mdclaw.config import Config, LiveConfig
from mdclaw.decisions import Decider
from mdclaw.failures import TurnFailure
from mdclaw.formatting import PromptMessage, addresses, format_prompt
from mdclaw.ipc.writers import write_follow_up
from mdclaw.launch import Launcher, RunFailed, RunRefused
from mdclaw.media import FileIntake, announced, not_saved_note
from mdclaw.outbox import describe_failures, failed_since
from mdclaw.paths import Layout
from mdclaw.preflight import DiskRule
from mdclaw.proxy import CredentialProxy
from mdclaw.queue import AgentAsk, GroupQueue, Job, MessageTurn
from mdclaw.replies import Replies
from mdclaw.runner import ContainerResult, ContainerRunner, RunHandle
from mdclaw.senders import HOST_NOTE, HOST_SENDER, Decision, decide
from mdclaw.state import Database, now_iso
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    get_session,
    line_messages,
    move_cursor,
    store_message,
)
from mdclaw.state.groups import (
    GroupRow,
    count_refusal,
    get_group,
    get_group_by_jid,
    list_groups,
)
from mdclaw.state.people import is_admitted
from mdclaw.state.tasks import TaskRow
from mdclaw.taskruns import TaskRuns
from mdclaw.transcribe import Transcriber, make_transcriber
from mdclaw.turns import Conversation, Ending, given_up, position, starts_turn, tell_retry

log = logging.getLogger("mdclaw.orchestrator")

MAX_PROMPT_MESSAGES = 50
# A message in a chat that is not a registered group: stored (main's agent sees the chat in
# its list of available groups), never run.
_UNREGISTERED = Decision(store=True, direct=False, run=False, refused=False)


class Orchestrator:
    """Glue between channels, the queue, the container runner and the outbox.

    `runner` may be None while the container engine is unreachable: jobs then fail (and are
    retried by the queue) with a clear reason. `proxy` None: no model path at all (tests,
    benchmarks), so the model pre-flight checks are skipped.
    """

    def __init__(self, cfg: Config | LiveConfig, db: Database, *,
                 runner: ContainerRunner | None, proxy: CredentialProxy | None = None,
                 channels: list[Channel] | None = None,
                 wake_outbox: Callable[[], None] = lambda: None,
                 max_concurrent: int | None = None, diskguard: DiskRule | None = None) -> None:
        # The config in force is read at use time (self.cfg); a reload reaches the queue's
        # limits and the transcriber through _config_changed.
        self.live = LiveConfig.of(cfg)
        cfg = self.live.current
        self.db = db
        self.layout = Layout(cfg.data_dir)
        self.runner = runner
        self.channels = channels or []
        self.wake_outbox = wake_outbox
        self._max_concurrent = max_concurrent  # given: it wins over the config's
        self.queue = GroupQueue(self.run_job, max_concurrent=self._slots(cfg),
                                max_attempts=cfg.limits.run_attempts,
                                retry_base=cfg.limits.run_retry_base.total_seconds(),
                                on_failure=self.on_job_failed, on_retry=self.on_job_retry)
        self._conv: dict[str, Conversation] = {}  # group -> its run in progress
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
        # Voice notes to text (transcription: in config); None when not configured.
        self.transcriber: Transcriber | None = make_transcriber(cfg.transcription)
        # Starting containers (with the disk rule: runs of a group past a disk limit are
        # refused); what their output and outcome write; scheduled tasks; files of messages.
        self.launcher = Launcher(config=lambda: self.cfg, runner=runner, proxy=proxy,
                                 diskguard=diskguard, engine_ready=self.engine_ready,
                                 stopping=self.stopping)
        self.replies = Replies(db, config=lambda: self.cfg,
                               wake_outbox=lambda: self.wake_outbox(), diskguard=diskguard)
        self.tasks = TaskRuns(db, config=lambda: self.cfg, queue=self.queue,
                              launcher=self.launcher, replies=self.replies,
                              conversations=self._conv,
                              engine_wait=lambda: self._engine_wait(first_try=False))
        # Other agents' questions (ask_agent): one turn each, through the same queue.
        self.asks = AgentAsks(db, config=lambda: self.cfg, queue=self.queue,
                              launcher=self.launcher, replies=self.replies, tasks=self.tasks,
                              conversations=self._conv,
                              engine_wait=lambda: self._engine_wait(first_try=False))
        # People's answers to cards by reply code, and admit cards for unknown senders
        # (mdclaw.decisions); the daemon sets it.
        self.decider: Decider | None = None
        self.intake = FileIntake(db, config=lambda: self.cfg,
                                 transcriber=lambda: self.transcriber,
                                 send_text=self.replies.send_text, on_saved=self._files_saved)
        self.live.subscribe(self._config_changed)

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    def _slots(self, cfg: Config) -> int:
        return self._max_concurrent or cfg.limits.max_concurrent_containers

    def _config_changed(self, old: Config, new: Config) -> None:
        """A reload: the queue takes the new limits (a raised cap starts waiting jobs now),
        and a changed `transcription` gets a transcriber of its own."""
        self.queue.configure(max_concurrent=self._slots(new),
                             max_attempts=new.limits.run_attempts,
                             retry_base=new.limits.run_retry_base.total_seconds())
        if new.transcription != old.transcription:
            self.transcriber = make_transcriber(new.transcription)

    # ------------------------------------------------------------------ inbound
    @staticmethod
    def _for_assistant(group: GroupRow, msg: InboundMessage | StoredMessage) -> bool:
        """True if the group's trigger rules (not who sent it) make `msg` a request: the
        group requires no trigger, or the message addresses the assistant (the main group
        too, when its config says requires_trigger: true)."""
        if not group.requires_trigger:
            return True
        if getattr(msg, "addressed", False):
            return True
        return addresses(msg.content, group.trigger) or any(
            addresses(str(f.get("transcript") or ""), group.trigger)
            for f in getattr(msg, "attachments", ()) if isinstance(f, dict))

    def decision(self, group: GroupRow | None,
                 msg: InboundMessage | StoredMessage) -> Decision:
        """What to do with `msg` in `group` (None: a chat that is no registered group)."""
        if group is None:
            return _UNREGISTERED
        if msg.sender == HOST_SENDER:
            return HOST_NOTE
        triggered = self._for_assistant(group, msg)
        who = self.sender_verdict(group, msg)
        if who is None:
            return decide(group.allow_senders, msg.sender, triggered=triggered)
        return people.decide(self.cfg, group.folder, who, triggered=triggered)

    def sender_verdict(self, group: GroupRow,
                       msg: InboundMessage | StoredMessage) -> people.Verdict | None:
        """Who sent `msg` for `group` by its `members` (mdclaw.people.verdict); None when the
        group has none."""
        return people.verdict(self.cfg, group.folder,
                              people.channel_of(msg.chat_jid, getattr(msg, "channel", "")),
                              msg.sender, lambda c, s, f: is_admitted(self.db, c, s, f))

    def is_triggered(self, group: GroupRow, msg: InboundMessage | StoredMessage) -> bool:
        """True if `msg` starts a turn of `group`'s agent (or joins the running one)."""
        return self.decision(group, msg).run

    def _decided(self, group: GroupRow,
                 msgs: Sequence[StoredMessage]) -> list[tuple[StoredMessage, Decision]]:
        """`msgs` with what the group's rules decide for each: what the turn rules read."""
        return [(m, self.decision(group, m)) for m in msgs]

    def _waiting(self, group: GroupRow, line: str | None, after: int | None) -> bool:
        """Messages of conversation `line` after `after` wait that start a turn."""
        return starts_turn(d for _m, d in self._decided(
            group, self._messages(group, line, after)))

    def _messages(self, group: GroupRow, line: str | None, after: int | None,
                  limit: int = 200) -> list[StoredMessage]:
        """The messages conversation `line` of `group` reads after `after` (every chat of
        the group in one order, or a per_chat conversation's chat alone)."""
        return line_messages(self.db, group.line(line), after, limit)

    @staticmethod
    def _line_of(group: GroupRow, chat: str | None) -> str | None:
        """The conversation a message of `chat` belongs to: the chat's own in a per_chat
        group, else the group's one (None)."""
        return chat if chat is not None and group.per_chat else None

    async def on_inbound(self, msg: InboundMessage) -> None:
        """Store `msg` once (unless its group drops it); run or feed its group's agent when
        the message is for it; count it when the group's allow_senders refused it.

        A message with files returns once it is stored: its files are downloaded and saved
        by a task of their own (mdclaw.media.FileIntake), so a big download never holds up
        the channel that handed the message over (nor other chats). Until the files are
        settled the message, and every later one of its chat, is held back from the agent
        (mdclaw.state.conversations), so the agent reads the chat in order."""
        t0 = time.perf_counter()
        if self.decider is not None and self.decider.take_reply(msg):
            return  # a person's answer to a card: not a message of the chat
        group = get_group_by_jid(self.db, msg.chat_jid)
        decision = self.decision(group, msg)
        if not decision.store and group is not None:
            self._ask_owner(group, msg)
        if decision.store:
            fetch = bool(msg.attachments) and group is not None
            files = (announced(msg.attachments) if fetch else
                     [s.as_dict() for s in not_saved_note(
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
                self.intake.take(group, msg, t0)
                return
        await self._after_stored(group, msg, decision, t0)

    def _ask_owner(self, group: GroupRow, msg: InboundMessage) -> None:
        """An unknown sender addressed the agent of a group with `unknown_senders:
        ask_owner`: the owner gets an admit card (mdclaw.decisions)."""
        spec = self.cfg.groups.get(group.folder)
        if (self.decider is None or spec is None or spec.unknown_senders != "ask_owner"
                or self.sender_verdict(group, msg) != "unknown"
                or not self._for_assistant(group, msg)):
            return
        self.decider.ask_admission(group, msg)

    def poke(self, folder: str) -> None:
        """Run the group's agent if messages wait for it (an admitted sender's message)."""
        group = get_group(self.db, folder)
        if group is None or group.jid is None or not self.accepting:
            return
        for line in group.lines():
            self._release_held(group, line)

    async def _files_saved(self, group: GroupRow, stored: StoredMessage, t0: float) -> None:
        """A message's files are settled: it is released to the agent."""
        decision = self.decision(group, stored)  # a transcript may name the trigger
        await self._after_stored(group, stored, decision, t0)
        if not decision.run and self.accepting:
            self._release_held(group, self._line_of(group, stored.chat_jid))

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
        self.dispatch(group, t_inbound=t0, chat=msg.chat_jid)

    def _release_held(self, group: GroupRow, line: str | None) -> None:
        """Run the agent for triggered messages of `group`'s conversation `line` that waited
        behind a message's files (their own dispatch found them held back)."""
        if group.jid is None:
            return
        conv = self._conv.get(group.folder)
        after = (conv.seen_upto if conv is not None and conv.line == line
                 else get_cursor(self.db, group.folder, line))
        if self._waiting(group, line, after):
            self.dispatch(group, chat=line)

    async def files_settled(self) -> None:
        """Wait until every file download under way has been settled (tests, shutdown)."""
        await self.intake.settled()

    def _log_refusal(self, group: GroupRow, msg: InboundMessage | StoredMessage,
                     decision: Decision) -> None:
        key = (group.folder, msg.sender)
        level = logging.DEBUG if key in self._refusals_logged else logging.INFO
        self._refusals_logged.add(key)
        rule = "members" if self.sender_verdict(group, msg) is not None else "allow_senders"
        log.log(level, "group %s: sender %r (%s) is not in %s; message %s %s",
                group.folder, msg.sender, msg.sender_name, rule, msg.id,
                "kept as context" if decision.store else "dropped")

    def _handle(self, folder: str) -> RunHandle | None:
        """The group's starting or running container, if any."""
        return self.launcher.handle(folder)

    def dispatch(self, group: GroupRow, *, t_inbound: float | None = None,
                 chat: str | None = None) -> None:
        """Feed the group's running conversation, or queue a run for it. `chat`: the chat
        of the message (in a per_chat group, its own conversation's)."""
        line = self._line_of(group, chat)
        handle = self._handle(group.folder)
        conv = self._conv.get(group.folder)
        running = handle is not None and not handle.closed and conv is not None
        if running and conv is not None and conv.line == line and conv.accepts_follow_ups:
            assert handle is not None
            self._feed(group, handle, conv)
            return
        if conv is not None and conv.line != line and not conv.scheduled:
            # Another chat's conversation of this per_chat group holds the container (or is
            # starting it): it ends once its turn is answered (as for a due task), then this
            # chat's runs.
            if conv.yield_for_task() and running:
                assert handle is not None
                log.info("group %s: closing the conversation of %s for one of %s",
                         group.folder, conv.line, line)
                handle.close()
        self.queue.enqueue_message(group.folder,
                                   payload=MessageTurn(t_inbound=t_inbound, chat=line),
                                   job_id=f"msg:{group.folder}{_at(line)}")

    def _enqueue_next(self, group: GroupRow, line: str | None, after: int | None) -> None:
        """Queue a run when triggered messages newer than `after` are waiting."""
        if self._waiting(group, line, after):
            self.queue.enqueue_message(group.folder, payload=MessageTurn(chat=line),
                                       job_id=f"msg:{group.folder}{_at(line)}:next")

    def _feed(self, group: GroupRow, handle: RunHandle, conv: Conversation) -> None:
        """Write the follow-ups the turn rules make of the messages since the last one the
        conversation saw into input/ (mdclaw.turns.Conversation.follow_ups)."""
        waiting = self._decided(group, self._messages(group, conv.line, conv.seen_upto))
        fed = 0
        for batch in conv.follow_ups(waiting):
            m = batch[-1]
            # Always the prompt's form: the person's text escaped, files as elements it
            # cannot imitate (mdclaw.formatting). The chat it came from goes with it: the
            # agent's tools answer there by default.
            write_follow_up(self.layout, group.folder, sender=m.sender,
                            sender_name=m.sender_name, content=self._prompt(batch, group=group),
                            timestamp=m.timestamp,
                            chat_jid=m.chat_jid if len(group.all_chats) > 1 else None)
            conv.fed(batch)
            conv.answer_to.append(m.chat_jid)
            fed += 1
        if fed:
            handle.touch()
            log.info("group %s: %d follow-up message(s) into the running conversation",
                     group.folder, fed)

    def _prompt(self, msgs: list[StoredMessage], failed: tuple[str, ...] = (), *,
                group: GroupRow | None = None) -> str:
        """`msgs` as the agent reads them: sender, local time and text of each (and the chat
        of each, for a group with several chats)."""
        several = group is not None and len(group.all_chats) > 1
        return format_prompt([PromptMessage(m.sender_name, m.content, m.timestamp,
                                            m.attachments, m.chat_jid if several else None)
                              for m in msgs],
                             self.cfg.assistant.timezone,
                             max_messages=MAX_PROMPT_MESSAGES, failed=failed)

    def recover_pending(self) -> int:
        """Queue a run for every group with triggered messages its agent has not seen yet
        (a crash, a stop or a failed run left them); return how many groups."""
        self.intake.settle_stale()
        n = 0
        for group in list_groups(self.db):
            if not group.jid:
                continue
            for line in group.lines():
                if self._waiting(group, line, get_cursor(self.db, group.folder, line)):
                    self.dispatch(group, chat=line)
                    n += 1
        if n:
            log.info("queued %d group(s) with messages not yet answered", n)
        return n

    # ------------------------------------------------------------------ message runs
    async def _run_messages(self, job: Job) -> None:
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        turn = job.payload if isinstance(job.payload, MessageTurn) else MessageTurn()
        line = self._line_of(group, turn.chat)
        if line not in group.lines():
            # Queued for a conversation the group no longer has (a reload switched its
            # `session`, or took the chat away): the conversations it has now run instead,
            # each from its own cursor, so nothing is answered twice.
            for own in group.lines():
                self._enqueue_next(group, own, get_cursor(self.db, group.folder, own))
            return
        start_cursor = get_cursor(self.db, group.folder, line)
        msgs = self._messages(group, line, start_cursor, limit=MAX_PROMPT_MESSAGES * 4)
        decided = self._decided(group, msgs)
        conv = Conversation.begin(start_cursor, decided)
        if conv is None:
            return  # nothing is for the agent: the messages wait as context
        # The turn answers in the chat of the newest message that runs it.
        reply = next((m.chat_jid for m, d in reversed(decided) if d.run), group.line(line)[0])
        conv.line, conv.answer_to = line, [reply]
        failed_deliveries = describe_failures(failed_since(self.db, group.folder,
                                                          self._told(group)))
        prompt = self._prompt(msgs, tuple(failed_deliveries.splitlines())
                              if failed_deliveries else (), group=group)
        job.payload = turn = replace(turn, upto=conv.last_pos, chat=line, reply=reply)
        self._conv[group.folder] = conv
        session = get_session(self.db, group.folder, line)
        marks = {"picked": time.perf_counter()}

        def on_output(block: str) -> None:
            conv.on_block()
            try:
                answer(block, conv.next_reply(reply))
            finally:
                if conv.close_for_task:
                    # A task is due: the turn is answered, so the conversation ends now.
                    handle = self._handle(group.folder)
                    if handle is not None and not handle.closed:
                        log.info("group %s: turn answered; closing the conversation for a "
                                 "due task", group.folder)
                        handle.close()

        def answer(block: str, to: str) -> None:
            out = self.replies.parse_block(group, block, line)
            if out is None:
                return
            if out.status == "error":
                failure = self.launcher.refine(group, TurnFailure.from_block(out))
                log.warning("group %s: turn failed in the container (%s): %s", group.folder,
                            failure.cause, failure.detail or "-")
                handle = self._handle(group.folder)
                reaction = conv.on_error(failure)
                if reaction.settle is not None:
                    self.replies.settle(group, reaction.settle, line=line, reply=to)
                if reaction.close and handle is not None:
                    handle.close()
                return
            settle, cursor = conv.on_answer()
            if settle is not None:
                self.replies.settle(group, settle, line=line, reply=to)
            if self.replies.deliver(group, out, to):
                marks.setdefault("first_output", time.perf_counter())
            # this turn's messages are done
            move_cursor(self.db, group.folder, cursor, line)

        await self._set_typing(reply, True)
        try:
            result = await self.launcher.run(
                group, lambda f: self.launcher.container_input(
                    group, prompt, session=session, scheduled=False, fields=f, chat=reply),
                on_output, engine_wait=self._engine_wait(first_try=job.attempts == 0))
        except RunRefused as e:
            self._conv.pop(group.folder, None)
            await self._set_typing(reply, False)
            # the messages wait for the next allowed run
            self.replies.refused(group, e.verdict, reply)
            return
        except RunFailed as e:
            self._conv.pop(group.folder, None)
            await self._set_typing(reply, False)
            settle = conv.not_started(e.failure) if e.failure is not None else None
            if settle is None:
                raise
            # Nothing ran: settle at once (config errors, a missing image).
            self.replies.settle(group, settle, line=line, reply=reply)
            self._enqueue_next(group, line, conv.last_pos)
            return
        finally:
            self._conv.pop(group.folder, None)
        await self._set_typing(reply, False)
        self._mark_told(group)
        self._record_timing(result, marks, turn.t_inbound)
        self._end_run(group, job, conv, result)

    def _end_run(self, group: GroupRow, job: Job, conv: Conversation,
                 result: ContainerResult) -> None:
        """The container of a message run ended: move the cursor, set messages aside, or
        roll back and raise RunFailed for the queue to retry, as the turn rules say."""
        line, reply = conv.line, conv.reply_chat
        stopped = self.launcher.stopped(group.folder, result)
        if stopped is not None:
            # The disk rule stopped it: say so; what was not answered waits, no retries.
            self.replies.refused(group, stopped, reply)
            self._roll_back(group, conv.stopped().cursor, line)
            return
        cause = None
        if conv.needs_cause(result.status == "success"):
            cause = self.launcher.refine(group, failures.from_result(result))
            log.warning("group %s: the run ended without an answer (%s): %s", group.folder,
                        cause.cause, cause.detail or "-")
        end = conv.end(cause)
        turn = job.payload if isinstance(job.payload, MessageTurn) else MessageTurn()
        job.payload = turn = replace(turn, upto=conv.last_pos, reply=reply)
        if end.ending is Ending.DONE:
            move_cursor(self.db, group.folder, end.cursor, line)
            # Messages that arrived after the prompt was built but could not be fed in.
            self._enqueue_next(group, line, end.next_after)
            return
        if end.settle is not None:
            self.replies.settle(group, end.settle, line=line, reply=reply)
            self._enqueue_next(group, line, end.next_after)
            return
        assert end.ending is Ending.RETRY and end.failure is not None
        if end.fresh_tries:
            job.attempts = 0
            job.payload = replace(turn, told_cause=None)
        self._roll_back(group, end.cursor, line)
        raise RunFailed(end.failure.detail or end.failure.cause, end.failure)

    def _roll_back(self, group: GroupRow, cursor: int | None, line: str | None) -> None:
        """Put the conversation's cursor back to `cursor`, the latest answered turn of a run
        (None: to no cursor at all), so what was not answered is in the next prompt."""
        move_cursor(self.db, group.folder, cursor, line)

    def _told(self, group: GroupRow) -> str | None:
        """When the agent was last given the group's failed deliveries (in a prompt)."""
        r = self.db.query_one("SELECT value FROM router_state WHERE key = ?",
                              (f"failures_told:{group.folder}",))
        return r[0] if r else None

    def _mark_told(self, group: GroupRow) -> None:
        with self.db.transaction() as c:
            c.execute("INSERT INTO router_state (key, value) VALUES (?, ?) ON CONFLICT(key) "
                      "DO UPDATE SET value = excluded.value",
                      (f"failures_told:{group.folder}", now_iso()))

    # ------------------------------------------------------------------ tasks and jobs
    async def execute_task(self, task: TaskRow) -> str:
        """The scheduler's executor: run `task` through the queue; return its result text
        (mdclaw.taskruns). Raises RunFailed when the run failed after the queue's retries."""
        return await self.tasks.execute(task)

    async def run_job(self, job: Job) -> Any:
        if isinstance(job.payload, AgentAsk):
            return await self.asks.run(job)
        if job.kind == "task":
            return await self.tasks.run(job)
        return await self._run_messages(job)

    async def on_job_failed(self, job: Job, error: BaseException) -> None:
        """The queue gave up on `job`: tell the scheduler, or settle the messages' failure
        and tell the chat."""
        failure = getattr(error, "failure", None) or TurnFailure(
            "agent_crash", detail=f"{type(error).__name__}: {error}")
        if isinstance(job.payload, AgentAsk):
            self.asks.abandon([job])
            return
        if job.kind == "task":
            self.tasks.failed(job, error, failure)
            return
        group = get_group(self.db, job.group)
        if group is None or group.jid is None:
            return
        if self.stopping.is_set() or not self.accepting:
            # Stopping: the messages stay unanswered and are run at the next start.
            return
        turn = job.payload if isinstance(job.payload, MessageTurn) else MessageTurn()
        line = self._line_of(group, turn.chat)
        after = get_cursor(self.db, group.folder, line)
        newest = None
        if turn.upto is None:
            waiting = self._messages(group, line, after)
            newest = position(waiting[-1]) if waiting else None
        settle = given_up(failure, after, turn.upto, newest)
        if settle is None:
            return
        self.replies.settle(group, settle, attempts=max(1, job.attempts), line=line,
                            reply=turn.reply)
        self._enqueue_next(group, line, settle.upto)

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
        turn = job.payload if isinstance(job.payload, MessageTurn) else MessageTurn()
        tell = tell_retry(turn.told_cause, failure)
        if tell:
            job.payload = turn = replace(turn, told_cause=failure.cause)
        self.replies.retrying(group, failure, attempts=job.attempts, upto=turn.upto,
                              delay=delay, tell=tell, reply=turn.reply)

    # ------------------------------------------------------------------ runs
    def _engine_wait(self, *, first_try: bool) -> float:
        """How long a run waits for an engine that is not ready yet: a first try briefly,
        so the chat hears at once when it is down; retries up to engine_wait."""
        return min(self.engine_wait, self.engine_first_wait) if first_try else self.engine_wait

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
        self.tasks.abandon(jobs)
        self.asks.abandon(jobs)

    def answering(self, folder: str) -> str | None:
        """The chat the group's running conversation is answering in now (the oldest open
        turn's), a task run's report chat, or None when nothing runs. Read from the IPC
        thread: one dict look-up and attribute reads of the conversation."""
        conv = self._conv.get(folder)
        return conv.reply_chat if conv is not None else None

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


def _at(line: str | None) -> str:
    """A per_chat conversation's part of a job id ('' for the group's one)."""
    return "" if line is None else f"@{line}"
