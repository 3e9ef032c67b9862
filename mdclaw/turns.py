"""The turn rules of a group's conversation, as plain state: which messages a turn takes, when
the cursor moves, what a failure does to it, and which new messages are fed to a running
conversation.

No I/O, no awaits, no clock: the orchestrator asks these rules, does the I/O (the database,
the container's input files, the outbox) and tells them what happened, the way the runner's
loop does with `RunTimers`. tests/test_turns.py holds each rule.

**The cursor** is the position of the newest message of the group's chat whose turn is done
(answered, or set aside for good). A run's prompt holds every message after it. The position
of a message is the sequence number the host gave it when it stored it (`position`), never
the chat service's clock: a message stored after the cursor moved is always after it, even
when it carries the same second. The cursor is such a number, or None before the first turn.
Nothing else here knows what a position is made of.

The rules:

* **A turn starts** only when a message after the cursor runs (`Decision.run`: it is for the
  assistant by the group's trigger rules and from an allowed sender). Messages that do not
  run stay stored and ride along as context in the prompt of the next turn (`begin`).
* **The cursor moves** past the messages given to the agent once a turn is answered
  (`on_answer`), and at the end of a run that failed no turn (`end`).
* **A message arriving while the conversation runs** is fed into it as a follow-up when it
  comes from an allowed sender (`follow_ups`), with the messages of others before it as its
  context; messages of others alone wait for the next turn. Nothing is fed into a scheduled
  task's run, nor into a conversation that is closing for a due task (`accepts_follow_ups`):
  those messages wait for the next run. Every follow-up is a turn of its own (`turns_open`).
* **A transient failure** (the model server is down, the container was killed...) rolls the
  cursor back to the latest answered turn of the run, so the same messages are retried with
  backoff (`end` says RETRY); a run that answered something before it failed starts its tries
  afresh. A turn that failed transiently while the conversation went on and a later one was
  answered cannot be retried on its own: its messages are set aside (`resend`). A transient
  failure reported when an answer already covered every message given leaves nothing to
  retry: it ends the conversation and nothing else.
* **A deterministic failure or a configuration error** is not retried: the turn's messages
  are set aside (marked failed, the cursor moves past them, the chat is told why) so the next
  message gets a normal answer; a configuration error also ends the conversation.
* **A run refused or stopped by the disk rule** moves nothing forward: what was not answered
  waits (the cursor goes back to the latest answered turn), and is not retried.
* **The queue gave up** on a run's tries: its messages are set aside as `gave_up`.
* **The chat is told of a retry** once per cause (`tell_retry`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from mdclaw.failures import CONFIG, TRANSIENT, TurnFailure
from mdclaw.senders import Decision

#: Where a message stands in its chat (the host's sequence number, mdclaw.state.conversations);
#: the cursor is one (or None: before the first message).
Position = int


class Message(Protocol):
    """What the rules read of a stored message."""

    @property
    def id(self) -> str: ...

    @property
    def seq(self) -> int: ...


M = TypeVar("M", bound=Message)


def position(msg: Message) -> Position:
    """A message's place in its chat, which the cursor is compared with."""
    return msg.seq


def starts_turn(decisions: Iterable[Decision]) -> bool:
    """Messages waiting start a turn (or join the running one) when one of them runs."""
    return any(d.run for d in decisions)


def outcome_for(failure: TurnFailure, *, gave_up: bool = False) -> str:
    """What a failed turn's messages are recorded as: `config` (the operator must change
    something), `dropped` (deterministic) or, once the queue gave up on a transient cause,
    `gave_up`."""
    if failure.policy == TRANSIENT and gave_up:
        return "gave_up"
    return "config" if failure.policy == CONFIG else "dropped"


def tell_retry(told_cause: str | None, failure: TurnFailure) -> bool:
    """Whether the chat hears of a retry: once per cause, again only when it changes."""
    return told_cause != failure.cause


@dataclass(frozen=True)
class Settle:
    """A turn failed for good: its messages after `after` up to `upto` are marked failed, the
    cursor moves to `upto`, the failure is recorded as `outcome` and the chat is told."""

    failure: TurnFailure
    after: Position | None
    upto: Position
    outcome: str


def given_up(failure: TurnFailure, cursor: Position | None, upto: Position | None,
             newest: Position | None) -> Settle | None:
    """The queue gave up on a message run: set aside its messages, up to the newest one its
    last try gave the agent (`upto`), else up to the newest one waiting (`newest`); None when
    there are none."""
    end = upto if upto is not None else newest
    if end is None:
        return None
    return Settle(failure, after=cursor, upto=end, outcome=outcome_for(failure, gave_up=True))


@dataclass(frozen=True)
class Reaction:
    """What to do about an output block: set messages aside, and/or close the conversation."""

    settle: Settle | None = None
    close: bool = False


class Ending(enum.Enum):
    DONE = "done"  # nothing failed: the cursor moves past every message given to the agent
    SETTLED = "settled"  # a failure that retrying cannot help: messages set aside
    RETRY = "retry"  # a transient failure: cursor rolled back, the queue tries again
    STOPPED = "stopped"  # the disk rule stopped the run: cursor rolled back, no retry


@dataclass(frozen=True)
class End:
    """How a message run ends."""

    ending: Ending
    # DONE: the new cursor; RETRY, STOPPED: the cursor to roll back to (None: no cursor).
    cursor: Position | None = None
    settle: Settle | None = None  # SETTLED
    failure: TurnFailure | None = None  # RETRY: the cause the queue retries for
    fresh_tries: bool = False  # RETRY: this run answered something first; tries start afresh
    # DONE, SETTLED: queue a run when messages after this one wait (they came too late to be
    # fed in, or after a conversation that closed).
    next_after: Position | None = None


@dataclass
class Conversation:
    """One run of a group's agent, as the turn rules see it."""

    start_cursor: Position | None  # the cursor when the run began
    last_pos: Position | None  # the newest message the agent was given
    scheduled: bool = False  # a scheduled task's run (single-turn, nothing is fed into it)
    sent_ids: set[str] = field(default_factory=set)
    answered_pos: Position | None = None  # the cursor after the latest answered/settled turn
    pending: TurnFailure | None = None  # a transient failure no later turn has answered
    pending_upto: Position | None = None  # the newest message given to the agent when it failed
    turns_open: int = 0  # prompts and follow-ups given to the agent, not yet answered
    yield_to_task: bool = False  # a task is due: close once no turn is open, feed no more
    # The chat of a per_chat group's conversation (None: the group's one conversation).
    line: str | None = None
    # The chat each open turn answers in, oldest first (the chat of the message it answers).
    answer_to: list[str] = field(default_factory=list)
    replied_in: str | None = None  # the chat the latest output block answered in

    def next_reply(self, default: str) -> str:
        """The chat the output block that came answers in: the oldest open turn's, else
        the latest one's, else `default`."""
        if self.answer_to:
            self.replied_in = self.answer_to.pop(0)
        return self.replied_in or default

    @property
    def reply_chat(self) -> str | None:
        """The chat the conversation answers in now: the oldest open turn's, else the latest
        answered one's."""
        return self.answer_to[0] if self.answer_to else self.replied_in

    # ------------------------------------------------------------------ starting
    @classmethod
    def begin(cls, cursor: Position | None,
              messages: Sequence[tuple[M, Decision]]) -> Conversation | None:
        """A message run over the messages after `cursor` (oldest first, with what the group's
        rules decided for each): every one goes into the prompt, as long as one of them runs;
        None when none does (no turn: they wait as context)."""
        if not starts_turn(d for _m, d in messages):
            return None
        return cls(start_cursor=cursor, last_pos=position(messages[-1][0]),
                   sent_ids={m.id for m, _d in messages}, answered_pos=cursor, turns_open=1)

    @classmethod
    def for_task(cls) -> Conversation:
        """A scheduled task's run: it takes no messages and is fed none."""
        return cls(start_cursor=None, last_pos=None, scheduled=True)

    # ------------------------------------------------------------------ questions
    @property
    def busy(self) -> bool:
        """The agent is working on a turn (an answer block has not come yet)."""
        return self.turns_open > 0

    @property
    def unanswered(self) -> bool:
        """Messages were given to the agent after the latest answered turn."""
        return self.last_pos != self.answered_pos

    @property
    def accepts_follow_ups(self) -> bool:
        """New messages may be fed into this run (else they wait for the next one)."""
        return not self.scheduled and not self.yield_to_task

    @property
    def seen_upto(self) -> Position | None:
        """The newest message this run has been given."""
        return self.last_pos

    @property
    def given(self) -> Position:
        """The newest message given to the agent; a message run always has one."""
        assert self.last_pos is not None, "a scheduled task's run is given no messages"
        return self.last_pos

    @property
    def close_for_task(self) -> bool:
        """A task is due and no turn is open: end the conversation now."""
        return self.yield_to_task and not self.busy

    def follow_ups(self, waiting: Sequence[tuple[M, Decision]]) -> list[list[M]]:
        """The follow-ups to write for `waiting` (the messages after `seen_upto`, oldest first,
        with their decisions): one per message of an allowed sender, each with the messages
        of others since the previous one before it as context. Messages of others after the
        last allowed one are not fed (they wait for the next prompt)."""
        batches: list[list[M]] = []
        context: list[M] = []
        for m, d in waiting:
            if m.id in self.sent_ids:
                continue
            if not d.direct:
                context.append(m)
                continue
            batches.append(context + [m])
            context = []
        return batches

    # ------------------------------------------------------------------ events
    def fed(self, batch: Sequence[Message]) -> None:
        """A follow-up of `batch` (from `follow_ups`) was written into the conversation."""
        self.sent_ids.update(m.id for m in batch)
        self.last_pos = position(batch[-1])
        self.turns_open += 1

    def on_block(self) -> None:
        """An output block came: one open turn is answered (or failed)."""
        self.turns_open = max(0, self.turns_open - 1)

    def on_error(self, failure: TurnFailure) -> Reaction:
        """The agent reported that a turn failed, while the conversation runs."""
        if failure.policy == TRANSIENT:
            # The conversation ends: the run's end rolls the cursor back and the queue
            # retries the unanswered messages with backoff (telling the chat once). When an
            # answer already covered every message given, nothing is left to retry (nor to
            # set aside later): the failure is not kept.
            if self.unanswered:
                self.pending = failure
                self.pending_upto = self.last_pos
            return Reaction(close=True)
        settle = None
        if self.last_pos is not None and self.unanswered:
            settle = Settle(failure, after=self.answered_pos, upto=self.last_pos,
                            outcome=outcome_for(failure))
            self.answered_pos = self.last_pos
        self.pending = None
        # A configuration error: every later turn would fail the same way.
        return Reaction(settle=settle, close=failure.policy == CONFIG)

    def on_answer(self) -> tuple[Settle | None, Position]:
        """The agent answered: (messages to set aside first, the new cursor). A turn that
        failed transiently before this answer cannot be retried on its own any more."""
        settle = None
        if self.pending is not None and self.pending_upto is not None:
            settle = Settle(self.pending, after=self.answered_pos, upto=self.pending_upto,
                            outcome="resend")
        self.pending = None
        self.answered_pos = self.given
        return settle, self.given

    def yield_for_task(self) -> bool:
        """A task of this group is due: feed nothing more and end the conversation once its
        turn is answered. True when that is now (no turn is open)."""
        self.yield_to_task = True
        return not self.busy

    # ------------------------------------------------------------------ ending
    def not_started(self, failure: TurnFailure) -> Settle | None:
        """The run could not start (nothing ran): a failure retrying cannot help sets the
        messages aside at once; None for a transient one (the queue retries, the cursor
        stays)."""
        if failure.policy == TRANSIENT:
            return None
        return Settle(failure, after=self.start_cursor, upto=self.given,
                      outcome=outcome_for(failure))

    def needs_cause(self, succeeded: bool) -> bool:
        """The run ended without success and without a failure reported for the messages it
        left unanswered: the caller names the cause from how the container ended."""
        return self.pending is None and not succeeded and self.unanswered

    def stopped(self) -> End:
        """The disk rule stopped the run: what was not answered waits, without retries."""
        return End(Ending.STOPPED, cursor=self.answered_pos)

    def end(self, cause: TurnFailure | None = None) -> End:
        """The container ended. `cause` is what the caller named when `needs_cause` asked
        for it; a transient failure still pending counts otherwise."""
        failure = self.pending or cause
        if failure is None:
            return End(Ending.DONE, cursor=self.given, next_after=self.given)
        if failure.policy != TRANSIENT:
            return End(Ending.SETTLED, next_after=self.given,
                       settle=Settle(failure, after=self.answered_pos, upto=self.given,
                                     outcome=outcome_for(failure)))
        # Transient: roll back to the latest answered turn; the queue retries the rest. A
        # run that answered something first failed on later messages: their tries (and what
        # the chat was told) start afresh.
        return End(Ending.RETRY, cursor=self.answered_pos, failure=failure,
                   fresh_tries=self.answered_pos != self.start_cursor)
