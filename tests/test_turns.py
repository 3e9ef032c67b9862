"""The turn rules (mdclaw.turns) on their own: plain state, no database, no container.

Each rule the orchestrator relies on, as the module's notes list them: which messages start a
turn and which ride along as context, what is fed into a running conversation, when the cursor
moves, what a transient, a deterministic and a configuration failure do to it, a run that
could not start, one the disk rule stopped, the queue giving up, and the retry notice told
once per cause. A hypothesis property plays random conversations (one output block per turn
given, as the agent runner writes them) and checks that no message is set aside twice and the
cursor never passes the newest message the agent was given.
(The same rules through the orchestrator, with the real database and queue:
tests/test_failed_turns.py, tests/test_senders.py, tests/test_tasks_on_time.py.)
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from mdclaw.failures import TurnFailure
from mdclaw.senders import Decision, SenderPolicy, decide
from mdclaw.turns import (
    Conversation,
    End,
    Ending,
    Reaction,
    Settle,
    given_up,
    outcome_for,
    position,
    starts_turn,
    tell_retry,
)

ONLY_ALICE = SenderPolicy(mode="trigger", ids=frozenset({"alice"}))
RUNS = decide(ONLY_ALICE, "alice", triggered=True)  # for the assistant, an allowed sender
CHAT = decide(ONLY_ALICE, "alice", triggered=False)  # an allowed sender, no trigger
OTHER = decide(ONLY_ALICE, "mallory", triggered=True)  # not allowed: context only

DOWN = TurnFailure("model_unreachable")  # transient
REFUSED = TurnFailure("model_refused")  # deterministic
NO_KEY = TurnFailure("key_missing")  # configuration


@dataclass(frozen=True)
class M:
    id: str
    seq: int
    timestamp: str = "2026-01-01T00:00:07.000Z"  # one second for all: the rules never read it


def m(i: int) -> M:
    return M(f"m{i}", 10 + i)


def ts(i: int) -> int:
    """The position of message `i`."""
    return m(i).seq


def conversation(*decided: tuple[M, Decision], cursor: int | None = None) -> Conversation:
    conv = Conversation.begin(cursor, list(decided))
    assert conv is not None
    return conv


# --------------------------------------------------------------------------- starting


def test_messages_without_a_trigger_start_no_turn_and_wait_as_context() -> None:
    assert Conversation.begin(None, []) is None
    assert Conversation.begin(None, [(m(1), CHAT), (m(2), OTHER)]) is None
    assert not starts_turn([CHAT, OTHER]) and starts_turn([CHAT, RUNS])


def test_a_turn_takes_every_message_after_the_cursor_once_one_of_them_runs() -> None:
    conv = conversation((m(2), CHAT), (m(3), OTHER), (m(4), RUNS), cursor=ts(1))
    assert conv.start_cursor == conv.answered_pos == ts(1)
    assert conv.last_pos == conv.seen_upto == ts(4)  # the context before the trigger too
    assert conv.sent_ids == {"m2", "m3", "m4"}
    assert conv.busy and conv.turns_open == 1 and conv.unanswered
    assert conv.accepts_follow_ups and not conv.scheduled
    assert position(m(4)) == ts(4)


def test_a_task_run_takes_no_messages_and_is_fed_none() -> None:
    task = Conversation.for_task()
    assert task.scheduled and not task.accepts_follow_ups and not task.busy


# --------------------------------------------------------------------------- follow-ups


def test_a_message_arriving_mid_turn_is_fed_with_the_context_before_it() -> None:
    conv = conversation((m(1), RUNS))
    waiting = [(m(1), RUNS), (m(2), OTHER), (m(3), RUNS), (m(4), CHAT), (m(5), OTHER)]
    batches = conv.follow_ups(waiting)
    # m1 was in the prompt; m2 rides with m3; an allowed sender's message is a follow-up of
    # its own even without a trigger; m5 (not allowed) alone waits for the next prompt.
    assert batches == [[m(2), m(3)], [m(4)]]
    assert conv.last_pos == ts(1) and conv.turns_open == 1  # asking changes nothing
    for batch in batches:
        conv.fed(batch)
    assert conv.last_pos == ts(4) and conv.sent_ids == {"m1", "m2", "m3", "m4"}
    assert conv.turns_open == 3
    assert conv.follow_ups(waiting) == []  # m5 still waits: nothing is fed twice


def test_nothing_is_fed_into_a_conversation_closing_for_a_due_task() -> None:
    conv = conversation((m(1), RUNS))
    assert conv.yield_for_task() is False  # a turn is open: it ends after that turn
    assert not conv.accepts_follow_ups and not conv.close_for_task
    conv.on_block()
    assert conv.close_for_task  # answered: close it now
    idle = conversation((m(1), RUNS))
    idle.on_block()
    assert idle.yield_for_task() is True  # nothing open: close at once


def test_an_output_block_answers_one_open_turn_and_never_goes_below_none() -> None:
    conv = conversation((m(1), RUNS))
    conv.fed([m(2)])
    conv.on_block()
    assert conv.busy
    conv.on_block()
    conv.on_block()
    assert conv.turns_open == 0 and not conv.busy


# --------------------------------------------------------------------------- answers


def test_an_answer_moves_the_cursor_past_every_message_given() -> None:
    conv = conversation((m(1), RUNS), cursor=None)
    conv.fed([m(2)])
    settle, cursor = conv.on_answer()
    assert settle is None and cursor == ts(2)
    assert conv.answered_pos == ts(2) and not conv.unanswered
    assert conv.end() == End(Ending.DONE, cursor=ts(2), next_after=ts(2))


def test_an_answer_after_a_transient_failure_sets_the_failed_turn_aside_to_resend() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    assert conv.on_error(DOWN).close  # the conversation ends to be retried...
    conv.fed([m(2)])  # ...but a later message was already in it, and gets answered
    settle, cursor = conv.on_answer()
    assert settle == Settle(DOWN, after=ts(0), upto=ts(1), outcome="resend")
    assert cursor == ts(2) and conv.pending is None
    assert conv.end().ending is Ending.DONE  # nothing left to retry


def test_a_transient_failure_after_an_answer_covered_every_message_leaves_nothing_pending(
        ) -> None:
    # Two turns given; the first block answers (covering both messages), the second is a
    # transient error: nothing is left to retry, and nothing to set aside later.
    conv = conversation((m(1), RUNS), cursor=ts(0))
    conv.fed([m(2)])
    conv.on_block()
    assert conv.on_answer() == (None, ts(2))
    conv.on_block()
    reaction = conv.on_error(DOWN)
    assert reaction == Reaction(close=True) and conv.pending is None
    assert conv.end() == End(Ending.DONE, cursor=ts(2), next_after=ts(2))  # no retry
    # A later turn that is answered sets no empty range aside (the chat is told nothing).
    conv.fed([m(3)])
    conv.on_block()
    assert conv.on_answer() == (None, ts(3))


# --------------------------------------------------------------------------- failures


def test_a_transient_failure_rolls_the_cursor_back_and_is_retried() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    reaction = conv.on_error(DOWN)
    assert reaction.close and reaction.settle is None
    assert conv.pending == DOWN and conv.pending_upto == ts(1)
    end = conv.end()
    assert end == End(Ending.RETRY, cursor=ts(0), failure=DOWN, fresh_tries=False)


def test_a_failure_after_an_answer_rolls_back_only_to_that_answer_with_fresh_tries() -> None:
    conv = conversation((m(1), RUNS), cursor=None)
    conv.on_block()
    conv.on_answer()
    conv.fed([m(2)])
    conv.on_block()
    conv.on_error(DOWN)
    end = conv.end()
    assert end.ending is Ending.RETRY and end.cursor == ts(1) and end.fresh_tries


def test_a_failure_before_any_answer_rolls_back_to_no_cursor_at_all() -> None:
    conv = conversation((m(1), RUNS), cursor=None)
    conv.on_error(DOWN)
    assert conv.end().cursor is None


def test_a_deterministic_failure_sets_the_turn_aside_and_the_conversation_goes_on() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    reaction = conv.on_error(REFUSED)
    assert reaction.settle == Settle(REFUSED, after=ts(0), upto=ts(1), outcome="dropped")
    assert not reaction.close and conv.answered_pos == ts(1)
    conv.fed([m(2)])
    conv.on_answer()
    assert conv.end() == End(Ending.DONE, cursor=ts(2), next_after=ts(2))


def test_a_configuration_error_sets_the_turn_aside_and_ends_the_conversation() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    reaction = conv.on_error(NO_KEY)
    assert reaction.close
    assert reaction.settle == Settle(NO_KEY, after=ts(0), upto=ts(1), outcome="config")


def test_an_error_when_every_turn_is_answered_sets_nothing_aside() -> None:
    conv = conversation((m(1), RUNS))
    conv.on_answer()
    assert conv.on_error(REFUSED).settle is None


def test_a_run_that_ended_without_an_answer_needs_a_cause_from_how_it_ended() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    assert not conv.needs_cause(succeeded=True)
    assert conv.needs_cause(succeeded=False)
    end = conv.end(TurnFailure("oom_killed"))
    assert end.ending is Ending.SETTLED and end.next_after == ts(1)
    assert end.settle == Settle(TurnFailure("oom_killed"), after=ts(0), upto=ts(1),
                                outcome="dropped")
    answered = conversation((m(1), RUNS))
    answered.on_answer()
    assert not answered.needs_cause(succeeded=False)  # nothing left unanswered
    pending = conversation((m(1), RUNS))
    pending.on_error(DOWN)
    assert not pending.needs_cause(succeeded=False)  # its failure is already known


def test_a_run_that_could_not_start_sets_aside_at_once_unless_retrying_can_help() -> None:
    conv = conversation((m(1), RUNS), (m(2), RUNS), cursor=ts(0))
    assert conv.not_started(DOWN) is None  # the queue retries; the cursor stays
    assert conv.not_started(NO_KEY) == Settle(NO_KEY, after=ts(0), upto=ts(2),
                                              outcome="config")
    assert conv.not_started(TurnFailure("context_too_long")).outcome == "dropped"


def test_a_run_the_disk_rule_stopped_waits_at_its_latest_answer_without_retries() -> None:
    conv = conversation((m(1), RUNS), cursor=ts(0))
    conv.on_answer()
    conv.fed([m(2)])
    assert conv.stopped() == End(Ending.STOPPED, cursor=ts(1))


# --------------------------------------------------------------------------- the queue


def test_when_the_queue_gives_up_the_messages_are_set_aside_as_given_up() -> None:
    assert given_up(DOWN, ts(0), ts(3), ts(5)) == Settle(DOWN, after=ts(0), upto=ts(3),
                                                         outcome="gave_up")
    # A try that never built its prompt: up to the newest message waiting.
    assert given_up(DOWN, ts(0), None, ts(5)).upto == ts(5)
    assert given_up(DOWN, ts(0), None, None) is None
    assert given_up(NO_KEY, None, ts(1), None).outcome == "config"
    assert outcome_for(DOWN) == "dropped" and outcome_for(DOWN, gave_up=True) == "gave_up"


def test_the_chat_hears_of_a_retry_once_per_cause() -> None:
    assert tell_retry(None, DOWN)
    assert not tell_retry("model_unreachable", DOWN)
    assert tell_retry("model_unreachable", TurnFailure("engine_down"))


# --------------------------------------------------------------------------- property

EVENTS = st.lists(st.one_of(
    st.tuples(st.just("feed"), st.sampled_from([RUNS, CHAT, OTHER])),
    st.tuples(st.just("answer"), st.none()),
    st.tuples(st.just("error"), st.sampled_from([DOWN, REFUSED, NO_KEY])),
), max_size=25)


@given(events=EVENTS, cursor=st.sampled_from([None, ts(0)]),
       ok=st.booleans(), cause=st.sampled_from([None, DOWN, REFUSED]))
def test_no_message_is_set_aside_twice_and_the_cursor_never_passes_what_was_given(
        events, cursor, ok, cause) -> None:  # noqa: ANN001
    conv = conversation((m(1), RUNS), cursor=cursor)
    settled: list[Settle] = []
    cursors: list[int | None] = []
    n = 1
    for kind, arg in events:
        if kind == "feed":
            n += 1
            for batch in conv.follow_ups([(m(n), arg)]):
                conv.fed(batch)
        elif not conv.busy:
            continue  # the agent answers each turn it was given once: no block without one
        elif kind == "answer":
            conv.on_block()
            settle, moved = conv.on_answer()
            settled += [settle] if settle else []
            cursors.append(moved)
        else:
            conv.on_block()
            reaction = conv.on_error(arg)
            settled += [reaction.settle] if reaction.settle else []
        assert conv.turns_open >= 0
    end = conv.end(cause if conv.needs_cause(ok) else None)
    settled += [end.settle] if end.settle else []
    cursors.append(end.cursor)
    newest = conv.given
    # Set-aside ranges follow one another: no message is in two of them.
    for before, after in zip(settled, settled[1:], strict=False):
        assert (after.after or 0) >= before.upto
    for s in settled:
        # Never empty: a range set aside holds a message (the chat is told to send it again).
        assert (s.after or 0) < s.upto <= newest
    # The cursor only ever names a message the agent was given (or where it started).
    for c in cursors:
        assert c is None or c == cursor or ts(1) <= c <= newest
    if end.ending is Ending.RETRY:
        # A retry is only for messages no answer covered.
        assert end.cursor == conv.answered_pos and conv.unanswered
