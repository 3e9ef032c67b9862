"""A due task starts on time whatever its group's conversation is doing.

The real orchestrator, queue, scheduler loop and database; a scripted stand-in for the
container runner that keeps a conversation open until `_close` (like the agent does), so an
idle conversation would hold the group's container until the idle timer without the fix.

(The same on the real engine and image: tests/e2e/test_tasks_on_time_e2e.py.)
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta
from typing import Any

from mdclaw import schedule
from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerResult
from mdclaw.scheduler import Scheduler
from mdclaw.state import Database
from mdclaw.state.outbox import list_outbox
from mdclaw.state.tasks import insert_task, list_runs, update_task_fields

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


class Handle:
    """A conversation container: follow-ups (touch) and `_close` (close) as events."""

    def __init__(self) -> None:
        self.closed = False
        self.closed_event = asyncio.Event()
        self.follow_ups: asyncio.Queue[None] = asyncio.Queue()
        self.last_activity = 0.0

    def close(self) -> None:
        self.closed = True
        self.closed_event.set()

    def touch(self) -> None:
        self.follow_ups.put_nowait(None)


class ConversationRunner:
    """Answers each turn once `gate` is set (set by default: the agent answers at once), keeps
    a conversation open until it is closed, and ends a scheduled task after its answer."""

    def __init__(self) -> None:
        self.handles: dict[str, Handle] = {}
        self.gate = asyncio.Event()
        self.gate.set()
        self.starts: list[tuple[str, datetime]] = []  # ("task"|"chat", when the run began)
        self.task_started = asyncio.Event()
        self.answered = asyncio.Event()  # set after every answer block
        self.turns = 0
        self.follow_ups = 0

    def active(self, folder: str) -> Handle | None:
        return self.handles.get(folder)

    async def _turn(self, on_output: Any, text: str) -> str:
        await self.gate.wait()
        self.turns += 1
        block = ok(text)
        on_output(block)
        self.answered.set()
        return block

    async def run(self, folder, input, *, on_output=None, timeout=None):  # noqa: ANN001
        kind = "task" if input.is_scheduled_task else "chat"
        self.starts.append((kind, schedule.utc_now()))
        if kind == "task":
            self.task_started.set()
        handle = self.handles[folder] = Handle()
        outputs = [await self._turn(on_output, f"{kind} answer {len(self.starts)}")]
        try:
            while kind == "chat":
                follow_up = asyncio.ensure_future(handle.follow_ups.get())
                closed = asyncio.ensure_future(handle.closed_event.wait())
                done, _ = await asyncio.wait({follow_up, closed},
                                             return_when=asyncio.FIRST_COMPLETED)
                follow_up.cancel()
                closed.cancel()
                if closed in done:
                    break
                self.follow_ups += 1
                outputs.append(await self._turn(on_output, "follow-up answer"))
        finally:
            self.handles.pop(folder, None)
        return ContainerResult(status="success", exit_code=0, timed_out=False, outputs=outputs,
                               name="c", closed_idle=handle.closed)


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
    runner = ConversationRunner()

    async def main() -> tuple[datetime, datetime, bool]:
        orch = Orchestrator(cfg, db, runner=runner)  # type: ignore[arg-type]
        orch.engine_ready.set()
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(runner.answered.wait(), 5)
        conversation = runner.active("main")
        assert conversation is not None and not conversation.closed  # open and idle
        due = schedule.utc_now() + timedelta(seconds=0.5)
        add_task(db, due)
        sched, loop = await started(orch, db)
        await asyncio.wait_for(runner.task_started.wait(), 10)
        await asyncio.wait_for(sched.drain(), 10)
        await sched.stop(5)
        loop.cancel()
        await asyncio.wait_for(orch.queue.join(), 5)
        return due, runner.starts[-1][1], conversation.closed

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
    runner = ConversationRunner()
    runner.gate.clear()  # the agent works on the first turn until the test lets it answer

    async def main() -> tuple[float, bool]:
        orch = Orchestrator(cfg, db, runner=runner)  # type: ignore[arg-type]
        orch.engine_ready.set()
        await orch.on_inbound(msg(1, "a long question"))
        while runner.active("main") is None:  # the conversation's container is up
            await asyncio.sleep(0.01)
        conversation = runner.active("main")
        assert conversation is not None
        add_task(db, schedule.utc_now())
        sched, loop = await started(orch, db)
        while not list_runs(db, "t1"):  # claimed on time
            await asyncio.sleep(0.01)
        # Busy: not cut off mid-turn, and no task container meanwhile.
        assert not await _within(conversation.closed_event.wait(), 0.5)
        assert not runner.task_started.is_set()
        # A message that comes now waits for the task: it is not fed into this turn.
        await orch.on_inbound(msg(2, "and another thing"))
        turn_done = asyncio.get_running_loop().time()
        runner.gate.set()  # the turn's answer arrives
        await asyncio.wait_for(runner.task_started.wait(), 10)
        after_turn = asyncio.get_running_loop().time() - turn_done
        await asyncio.wait_for(sched.drain(), 10)
        await sched.stop(5)
        loop.cancel()
        while len(runner.starts) < 3 or runner.turns < 3:  # message 2's own conversation
            await asyncio.sleep(0.01)
        last = runner.active("main")
        assert last is not None
        last.close()  # what its idle timer would do
        await asyncio.wait_for(orch.queue.join(), 10)
        return after_turn, conversation.closed

    after_turn, closed = asyncio.run(main())
    assert closed
    assert after_turn < ON_TIME, f"the task started {after_turn:.2f} s after the turn ended"
    assert runner.follow_ups == 0  # message 2 was not fed into the closing conversation
    # The turn's answer first, then the task, then message 2 in a new container.
    assert [k for k, _ in runner.starts] == ["chat", "task", "chat"]
    assert texts(db) == ["chat answer 1", "task answer 2", "chat answer 3"]
    (run,) = list_runs(db, "t1")
    assert run.start_note is not None
    assert run.start_note.startswith("waited ")
    assert "for the conversation's turn to finish" in run.start_note


async def _within(aw: Any, seconds: float) -> bool:
    """True if `aw` finished within `seconds`."""
    try:
        await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        return False
    return True
