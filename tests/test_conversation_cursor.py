"""No message is lost to the conversation cursor: messages that carry the same timestamp (chat
services give whole seconds) before, during and after a turn, and across a restart, are each
given to the agent and answered exactly once.

The real orchestrator, queue, database and ContainerRunner run in-process over the tests' fake
engine, whose containers answer like the agent runner here (tests/fake_engine.py, chat_agent):
each prompt and each follow-up file gets one answer. (The same through the Telegram channel
against a fake Bot API: tests/test_channel_telegram.py.)
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable

from fake_engine import FakeEngine, chat_agent
from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.state import Database
from mdclaw.state.outbox import list_outbox
from waiting import wait_until_async

CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "tg:100", main: true}
limits: {run_attempts: 1, idle_timeout: 10m}
"""

SECOND = "2026-01-01T00:00:07.000Z"  # every message of the test: one whole second
TOKEN = re.compile(r"tok\d{3}tok")


def msg(i: int) -> InboundMessage:
    return InboundMessage(id=f"tg:100:{i}", chat_jid="tg:100", sender="42",
                          sender_name="Alice", content=f"please answer tok{i:03d}tok",
                          timestamp=SECOND, channel="telegram")


async def until(pred: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait (polling the in-process state) until `pred()`; fail naming `what`."""
    await wait_until_async(pred, timeout, what=what)


def tokens(texts: list[str]) -> Counter[str]:
    return Counter(t for text in texts for t in TOKEN.findall(text))


class Host:
    """One start of the host: an orchestrator with the real runner over `engine`."""

    def __init__(self, cfg, db: Database, engine: FakeEngine) -> None:  # noqa: ANN001
        self.db = db
        self.runner = ContainerRunner(cfg, engine)
        self.orch = Orchestrator(cfg, db, runner=self.runner)
        self.orch.engine_ready.set()

    def idle(self) -> bool:
        q = self.orch.queue
        return not q.running_groups() and not q.pending() and self.runner.active("main") is None

    async def end_conversation(self) -> None:
        """Close the open conversation (as the idle timer would) and wait for its run's end."""
        handle = self.runner.active("main")
        assert handle is not None, "no conversation is open"
        handle.close()
        await until(self.idle, "the conversation's run ended")

    async def stop(self) -> None:
        """Stop as the daemon does: take no more work, close conversations, drain."""
        self.orch.accepting = False
        self.orch.close_conversations()
        self.orch.abandon(await self.orch.queue.shutdown(grace=10))
        await self.runner.aclose()


def answers(db: Database) -> list[str]:
    return [r.text or "" for r in list_outbox(db)]


def test_messages_of_one_second_around_a_turn_and_a_restart_are_each_answered_once(
        write_config) -> None:
    cfg = load_config(write_config(CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    heard: list[str] = []
    engine = FakeEngine(default=chat_agent(heard=heard))

    def given(n: int) -> Callable[[], bool]:
        return lambda: len(heard) >= n and len(answers(db)) >= n

    async def first_start() -> None:
        host = Host(cfg, db, engine)
        try:
            # Before the turn: two messages of the same second go into its prompt.
            q = host.orch.queue
            q.max_concurrent = 0  # hold the run until both are stored
            await host.orch.on_inbound(msg(1))
            await host.orch.on_inbound(msg(2))
            q.configure(max_concurrent=1, max_attempts=q.max_attempts, retry_base=q.retry_base)
            await until(given(1), "the first prompt answered")
            # During the turn: answered, the cursor moved to that second, the conversation
            # still open. A message of the same second is fed into it as a follow-up.
            await host.orch.on_inbound(msg(3))
            await until(given(2), "message 3 (same second, conversation open) answered")
            await host.end_conversation()
            # After the turn: the run has ended; a message of the same second starts a run.
            await host.orch.on_inbound(msg(4))
            await until(given(3), "message 4 (same second, after the run) answered")
            await host.end_conversation()
            # Stored while the host is stopping: answered after the restart.
            host.orch.accepting = False
            await host.orch.on_inbound(msg(5))
        finally:
            await host.stop()

    async def second_start() -> None:
        host = Host(cfg, db, engine)
        try:
            assert host.orch.recover_pending() == 1
            await until(given(4), "message 5 (same second, stored before a restart) answered")
            await host.orch.on_inbound(msg(6))
            await until(given(5), "message 6 (same second, after the restart) answered")
            await host.end_conversation()
            assert host.orch.recover_pending() == 0  # nothing is left waiting
        finally:
            await host.stop()

    try:
        asyncio.run(first_start())
        db.close()
        db = Database(cfg.db_path)  # the restart opens the database anew
        asyncio.run(second_start())
        expected = Counter(f"tok{i:03d}tok" for i in range(1, 7))
        assert tokens(heard) == expected  # each given to the agent once
        assert tokens(answers(db)) == expected  # and each answered once
        assert db.scalar("SELECT COUNT(*) FROM messages WHERE failed_cause IS NOT NULL") == 0
    finally:
        db.close()
