"""Waiting for background tasks at a stop (mdclaw.aio.wait_all) and the components that do.

A task can be done while its done callback, which takes it out of its component's set, is
still queued for the loop's next turn. Since Python 3.12 `asyncio.gather` of tasks that are
all done is done at once, without a turn of the loop, so a stop written as `while tasks:
await gather(*tasks)` gathered that task again and again and never returned (the container
runner's close hung so under Python 3.13, the appliance's Python). The stops run here in a
child process, which a hang cannot take with it: it is killed at its timeout. This file
runs under Python 3.12+ too (`make test-newer-python`), where the old loop hangs.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from mdclaw.aio import wait_all

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# A task that starts another as it ends; that one ends in its second step, which comes in the
# turn that resumes the stop's wait, before its done callback: the stop finds it done and
# still in the set.
LATE_ENDER = """
import asyncio, sys
async def late_ender(spawn):
    async def two_steps():
        await asyncio.sleep(0)
    async def first():
        spawn(two_steps())
    spawn(first())
"""


def child_prints(code: str, *args: str, timeout: float = 60) -> str:
    """What `code` prints in a child process that exits 0 within `timeout` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_wait_all_returns_when_a_task_ends_as_the_wait_resumes() -> None:
    code = LATE_ENDER + """
from mdclaw.aio import wait_all
async def main():
    tasks = set()
    def spawn(coro):
        t = asyncio.ensure_future(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    for _ in range(50):
        await late_ender(spawn)
        await wait_all(tasks)
        assert not tasks, tasks
    print("returned")
asyncio.run(main())
"""
    assert child_prints(code) == "returned"


def test_the_container_runner_closes_when_a_removal_ends_as_its_close_resumes(
        write_config: Any) -> None:
    cfg_path = write_config()
    code = LATE_ENDER + """
from fake_engine import FakeEngine
from mdclaw.config import load_config
from mdclaw.runner import ContainerRunner
async def main():
    runner = ContainerRunner(load_config(sys.argv[1]), FakeEngine())
    await late_ender(runner._spawn)
    await runner.aclose()
    print("closed", len(runner._background))
asyncio.run(main())
"""
    assert child_prints(code, str(cfg_path)) == "closed 0"


def test_web_push_drains_when_a_push_ends_as_its_drain_resumes(tmp_path: Path) -> None:
    code = LATE_ENDER + """
from pathlib import Path
from mdclaw.channels.webpush import WebPush
async def main():
    push = WebPush(Path(sys.argv[1]))
    def spawn(coro):
        t = asyncio.ensure_future(coro)
        push._tasks.add(t)
        t.add_done_callback(push._tasks.discard)
    await late_ender(spawn)
    await push.drain()
    print("drained", len(push._tasks))
asyncio.run(main())
"""
    assert child_prints(code, str(tmp_path)) == "drained 0"


def test_wait_all_waits_for_tasks_started_while_it_waits() -> None:
    async def main() -> list[str]:
        tasks: set[asyncio.Task[None]] = set()
        done: list[str] = []
        gate = asyncio.Event()

        def spawn(name: str, coro: Any) -> None:
            t = asyncio.ensure_future(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def later(name: str) -> None:
            await gate.wait()
            done.append(name)

        async def starter() -> None:
            await asyncio.sleep(0.01)
            spawn("b", later("b"))  # started after the wait began
            gate.set()
            done.append("a")

        spawn("a", starter())
        await asyncio.wait_for(wait_all(tasks), 10)
        assert not tasks
        return done

    assert asyncio.run(main()) == ["a", "b"]


def test_wait_all_takes_a_failed_tasks_exception_and_waits_for_the_others() -> None:
    """A failed task does not end the wait early, and its exception is taken: the loop's
    "exception was never retrieved" is not reported for it."""
    reported: list[str] = []

    async def main() -> bool:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: reported.append(str(ctx.get("message"))))
        tasks: set[asyncio.Task[None]] = set()
        slow_done = asyncio.Event()

        async def fails() -> None:
            raise RuntimeError("a removal failed")

        async def slow() -> None:
            await asyncio.sleep(0.05)
            slow_done.set()

        for coro in (fails(), slow()):
            t = asyncio.ensure_future(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        del t
        await asyncio.sleep(0)  # the failure first: done before the wait starts
        await wait_all(tasks)
        gc.collect()
        return slow_done.is_set()

    assert asyncio.run(main()) is True
    gc.collect()
    assert not [m for m in reported if "never retrieved" in m], reported
