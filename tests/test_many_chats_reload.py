"""Switching a group's `session` (shared <-> per_chat) on a reload while its conversation is
running, on a real daemon (tests/test_many_chats_daemon.py's world: the fake Bot API, the web
chat, the fake engine): every message is answered exactly once. The turn the running
conversation answers after the reload is not given to the agent again by the conversation(s)
the new mode runs, and neither is anything that conversation was fed."""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter

import pytest

from fake_engine import FakeContainer
from test_many_chats_daemon import World, run_daemon, world  # noqa: F401 - the fixture

HOLD = "hold"


class HoldingAgent:
    """Answers every message of its prompt or follow-up ("re: <text>", one line each), except
    that a turn holding a message with "hold" in it waits until `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()
        self.heard: list[str] = []  # every message text given to the agent, as often as given
        self.lock = threading.Lock()

    def __call__(self, c: FakeContainer) -> int:
        text: str | None = c.prompt
        while text is not None:
            said = re.findall(r"<message [^>]*>(.*?)</message>", text, re.S) or [text]
            with self.lock:
                self.heard += said
            if any(HOLD in s for s in said):
                self.holding.set()
                c.wait_for(self.release.is_set, what="the test's release")
            c.say({"status": "success", "result": "\n".join(f"re: {s}" for s in said)})
            got = c.next_input(timeout=60)
            text = None if got is None else str(got.get("content", ""))
        return 0


async def _quiet(w: World) -> None:
    """Let every queued run of the group happen: end its conversations until the queue is
    idle (a duplicate run queued behind them runs too, and is counted)."""
    assert w.d is not None and w.d.orch is not None
    orch = w.d.orch
    for _ in range(60):
        assert orch.runner is not None
        handle = orch.runner.active("me")
        if handle is not None and not handle.closed:
            handle.close()
        try:
            await asyncio.wait_for(orch.queue.join(), 0.5)
            return
        except TimeoutError:
            continue
    raise AssertionError(f"the queue never went idle: {orch.queue.status()}")


def tg_lines(w: World) -> list[str]:
    return [line for block in w.telegram_out() for line in block.splitlines()]


async def _answers(w: World) -> Counter[str]:
    out = w.telegram_out() + await w.web_out("hl:me")
    return Counter(line for block in out for line in block.splitlines())


@pytest.mark.parametrize("before,after", [("shared", "per_chat"), ("per_chat", "shared")])
def test_a_session_switch_during_a_running_turn_answers_each_message_once(
        world: World, before: str, after: str) -> None:  # noqa: F811 - the fixture
    w = world
    agent = HoldingAgent()

    async def body() -> None:
        assert w.d is not None
        w.telegram("first")
        await w.until(lambda: "re: first" in tg_lines(w), "the first answer")
        w.telegram(f"{HOLD} this one")
        await w.until(agent.holding.is_set, "the held turn under way")
        # The config switches the session while the turn runs.
        w.write_config(after)
        assert await w.d.reload()
        agent.release.set()
        await w.until(lambda: f"re: {HOLD} this one" in tg_lines(w), "the held answer")
        # The next messages run in the new mode's conversation(s).
        w.telegram("second")
        await w.until(lambda: "re: second" in tg_lines(w), "the second answer")
        await w.web("third")
        await w.web_until("hl:me", "re: third")
        await _quiet(w)
        answers = await _answers(w)
        twice = {a: n for a, n in answers.items() if n != 1}
        assert not twice, f"answered more than once: {twice}; all: {answers}"
        given = Counter(agent.heard)
        assert {t: n for t, n in given.items() if n != 1} == {}, given
        assert set(given) == {"first", f"{HOLD} this one", "second", "third"}

    w.agent = agent  # type: ignore[assignment] - the engine runs it in every container
    run_daemon(w, before, body)
