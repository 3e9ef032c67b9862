"""A due task starts on time whatever its group's conversation is doing.

The real orchestrator, queue, scheduler loop, database and container runner, over the tests'
fake engine whose agent keeps a conversation open until `_close` (like the agent does), so an
idle conversation would hold the group's container until the idle timer without the fix.

(The same on the real engine and image: tests/e2e/test_tasks_on_time_e2e.py.)
"""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import datetime, timedelta
from typing import Any

from fake_engine import FakeContainer, FakeEngine
from mdclaw import schedule
from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.scheduler import Scheduler
from mdclaw.state import Database
from mdclaw.state.outbox import list_outbox
from mdclaw.state.tasks import insert_task, list_runs, update_task_fields
from waiting import holds_for, wait_until_async

CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "hl:main", main: true}
limits: {run_attempts: 1, idle_timeout: 10m}
"""

ON_TIME = 2.0  # seconds from due to the task's container start


def msg(i: int, text: str) -> InboundMessage:
    return InboundMessage(id=f"m{i}", chat_jid="hl:main", sender="u1", sender_name="Alice",
                          content=text, timestamp=f"2026-01-01T00:00:{i:02d}.000Z",
                          channel="http")


def ok(text: str) -> str:
    return json.dumps({"status": "success", "result": text, "newSessionId": "s-1"})


class Conversations:
    """The fake engine's agent: answers each turn once `gate` is set (set by default: it
    answers at once), keeps a conversation open until `_close` (answering each follow-up),
    and ends a scheduled task after its answer."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.engine = FakeEngine(default=self.agent)
        self.answered = threading.Event()  # set after every answer block
        self.turns = 0

    def agent(self, c: FakeContainer) -> int:
        kind = "task" if c.is_task else "chat"
        self._turn(c, f"{kind} answer {len(self.engine.containers)}")
        while kind == "chat" and c.next_input(timeout=60) is not None:
            self._turn(c, "follow-up answer")
        return 0

    def _turn(self, c: FakeContainer, text: str) -> None:
        c.wait_for(self.gate.is_set, 60, what="the test to let the turn answer")
        self.turns += 1
        c.say(ok(text))
        self.answered.set()

    @property
    def starts(self) -> list[tuple[str, datetime]]:
        """("task"|"chat", when its container started), in order."""
        return [("task" if c.is_task else "chat", c.started_at)
                for c in self.engine.containers]

    def task_started(self) -> bool:
        return any(c.is_task for c in self.engine.containers)

    @property
    def follow_ups(self) -> int:
        return sum(len(c.follow_ups) for c in self.engine.containers)


def orchestrator(cfg: Any, db: Database, agent: Conversations) -> Orchestrator:
    orch = Orchestrator(cfg, db, runner=ContainerRunner(cfg, agent.engine))
    orch.engine_ready.set()
    return orch


def setup(write_config) -> tuple[Any, Database]:  # noqa: ANN001
    cfg = load_config(write_config(CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    return cfg, db


def add_task(db: Database, due: datetime, tid: str = "t1") -> None:
    with db.transaction() as c:
        insert_task(c, group_folder="main", chat_jid="hl:main", prompt="water the plants",
                    schedule_type="interval", schedule_value="3600000", timezone="UTC",
                    task_id=tid)
        update_task_fields(c, tid, next_run=schedule.to_iso(due))


def texts(db: Database) -> list[str]:
    return [r.text for r in reversed(list_outbox(db))]


async def started(orch: Orchestrator, db: Database) -> tuple[Scheduler, asyncio.Task[None]]:
    sched = Scheduler(db, orch.execute_task)
    return sched, asyncio.ensure_future(sched.run())


def test_an_idle_conversation_is_closed_and_the_task_starts_within_2_s(write_config) -> None:
    cfg, db = setup(write_config)
    agent = Conversations()

    async def main() -> tuple[datetime, datetime, bool]:
        orch = orchestrator(cfg, db, agent)
        await orch.on_inbound(msg(1, "hello"))
        await wait_until_async(agent.answered.is_set, 5)
        conversation = orch.runner.active("main")
        assert conversation is not None and not conversation.closed  # open and idle
        due = schedule.utc_now() + timedelta(seconds=0.5)
        add_task(db, due)
        sched, loop = await started(orch, db)
        await wait_until_async(agent.task_started, 10)
        await asyncio.wait_for(sched.drain(), 10)
        await sched.stop(5)
        loop.cancel()
        await asyncio.wait_for(orch.queue.join(), 5)
        return due, agent.starts[-1][1], conversation.closed

    due, task_start, closed = asyncio.run(main())
    assert closed  # the idle conversation was closed for the task, not left to its idle timer
    late = (task_start - due).total_seconds()
    assert 0 <= late < ON_TIME, f"the task started {late:.2f} s after due"
    (run,) = list_runs(db, "t1")
    assert run.status == "success" and run.result == "task answer 2"
    assert run.due_at == schedule.to_iso(due)
    assert run.started_at is not None
    assert (schedule.from_iso(run.started_at) - due).total_seconds() < ON_TIME
    assert run.start_note is not None and "idle conversation" in run.start_note
    assert texts(db) == ["chat answer 1", "task answer 2"]


def test_a_busy_conversation_finishes_its_turn_then_the_task_runs(write_config) -> None:
    cfg, db = setup(write_config)
    agent = Conversations()
    agent.gate.clear()  # the agent works on the first turn until the test lets it answer

    async def main() -> tuple[float, bool]:
        orch = orchestrator(cfg, db, agent)
        await orch.on_inbound(msg(1, "a long question"))
        # The conversation's container is up.
        conversation = await wait_until_async(
            lambda: (h := orch.runner.active("main")) and h.container_id and h)
        add_task(db, schedule.utc_now())
        sched, loop = await started(orch, db)
        await wait_until_async(lambda: list_runs(db, "t1"))  # claimed on time
        # Busy: not cut off mid-turn, and no task container meanwhile.
        await holds_for(lambda: not conversation.closed and not agent.task_started(), 0.5,
                        what="the busy conversation stays open, no task container")
        # A message that comes now waits for the task: it is not fed into this turn.
        await orch.on_inbound(msg(2, "and another thing"))
        turn_done = asyncio.get_running_loop().time()
        agent.gate.set()  # the turn's answer arrives
        await wait_until_async(agent.task_started, 10)
        after_turn = asyncio.get_running_loop().time() - turn_done
        await asyncio.wait_for(sched.drain(), 10)
        await sched.stop(5)
        loop.cancel()
        # Message 2's own conversation.
        await wait_until_async(lambda: len(agent.starts) >= 3 and agent.turns >= 3)
        last = orch.runner.active("main")
        assert last is not None
        last.close()  # what its idle timer would do
        await asyncio.wait_for(orch.queue.join(), 10)
        return after_turn, conversation.closed

    after_turn, closed = asyncio.run(main())
    assert closed
    assert after_turn < ON_TIME, f"the task started {after_turn:.2f} s after the turn ended"
    assert agent.follow_ups == 0  # message 2 was not fed into the closing conversation
    # The turn's answer first, then the task, then message 2 in a new container.
    assert [k for k, _ in agent.starts] == ["chat", "task", "chat"]
    assert texts(db) == ["chat answer 1", "task answer 2", "chat answer 3"]
    (run,) = list_runs(db, "t1")
    assert run.start_note is not None
    assert run.start_note.startswith("waited ")
    assert "for the conversation's turn to finish" in run.start_note

