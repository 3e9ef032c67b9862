"""A run's timers, and the loop that follows a container.

`RunTimers` is plain state over a clock, so its rules are tested here with a fake one: the
idle timer (reset by output and follow-ups, off once the conversation is closed), the hard
timer (reset by output only), the stop grace and the repeated kill, the idle clamp. A
hypothesis property replays random runs against the decisions of the hand-written loop
`RunTimers` replaced, transcribed below as the oracle.

The loop itself (`ContainerRunner.run` with `_RunLoop`) is tested against a fake runtime whose
container is a script in a thread: the output callback, the idle `_close`, `touch()`, the hard
stop, the kill of a container that ignores its stop, cancellation, and the result's fields.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw import runner as runner_mod
from mdclaw.config import Config
from mdclaw.runner import (
    CLOSE_SENTINEL,
    OUTPUT_END,
    OUTPUT_START,
    STOP_GRACE_SECONDS,
    STOP_WAIT_SECONDS,
    ContainerInput,
    ContainerRunner,
    Due,
    RunTimers,
    _kill_quietly,
    _remove_quietly,
)
from mdclaw.runtime import (
    STDERR,
    STDOUT,
    ContainerInfo,
    ContainerRuntime,
    EngineCallError,
    EngineUnavailable,
    ImageInfo,
    RunningContainer,
    RunSpec,
)
from waiting import wait_until, wait_until_async

HARD, IDLE = 100.0, 10.0


def timers(hard: float = HARD, idle: float = IDLE, now: float = 0.0) -> RunTimers:
    return RunTimers(hard, idle, now)


# --------------------------------------------------------------------------- RunTimers


def test_nothing_is_due_at_the_start_and_the_idle_timer_comes_first() -> None:
    t = timers()
    assert t.due(0.0) is Due.NOTHING
    assert t.wait_seconds(0.0) == IDLE
    assert t.wait_seconds(4.0) == IDLE - 4.0
    assert not t.closed and not t.timed_out


def test_the_idle_timer_closes_after_output_goes_quiet() -> None:
    t = timers()
    t.on_block(5.0)
    assert t.due(5.0 + IDLE - 0.001) is Due.NOTHING
    assert t.due(5.0 + IDLE) is Due.CLOSE_IDLE
    assert t.due(5.0 + IDLE + 3.0) is Due.CLOSE_IDLE  # late is still due


def test_a_follow_up_postpones_the_idle_timer() -> None:
    t = timers()
    t.on_touch(8.0)
    assert t.due(IDLE) is Due.NOTHING
    assert t.wait_seconds(IDLE) == pytest.approx(8.0)
    assert t.due(8.0 + IDLE) is Due.CLOSE_IDLE


def test_a_follow_up_does_not_postpone_the_hard_timer() -> None:
    t = timers(hard=20.0, idle=10.0)
    for now in (5.0, 12.0, 19.0):
        t.on_touch(now)
    assert t.due(19.999) is Due.NOTHING
    assert t.due(20.0) is Due.STOP_HARD


def test_each_output_block_restarts_the_hard_timer() -> None:
    t = timers(hard=20.0, idle=10.0)
    t.on_close()  # the idle timer out of the way
    for now in (15.0, 30.0, 45.0):
        assert t.due(now) is Due.NOTHING
        t.on_block(now)
    assert t.hard_deadline == 65.0
    assert t.due(64.999) is Due.NOTHING
    assert t.due(65.0) is Due.STOP_HARD


def test_after_close_only_the_hard_timer_counts() -> None:
    t = timers()
    t.on_block(1.0)
    t.on_close()
    assert t.closed
    assert t.due(1.0 + IDLE + 1.0) is Due.NOTHING
    assert t.wait_seconds(1.0 + IDLE + 1.0) == pytest.approx(HARD - IDLE - 1.0)
    t.on_touch(50.0)  # a follow-up after close changes nothing
    assert t.next_deadline() == 1.0 + HARD
    assert t.due(1.0 + HARD) is Due.STOP_HARD


def test_close_stays_closed() -> None:
    t = timers()
    t.on_close()
    t.on_close()
    t.on_block(3.0)
    assert t.closed and t.due(3.0 + IDLE) is Due.NOTHING


def test_the_hard_timer_wins_when_both_are_due() -> None:
    t = timers(hard=20.0, idle=10.0)
    assert t.due(25.0) is Due.STOP_HARD


def test_the_stop_gets_its_grace_then_the_container_is_killed() -> None:
    t = timers(hard=20.0, idle=10.0)
    assert t.due(20.0) is Due.STOP_HARD
    t.on_stop_requested(20.0)
    assert t.timed_out
    deadline = 20.0 + STOP_GRACE_SECONDS + STOP_WAIT_SECONDS
    assert t.stop_deadline == deadline
    assert t.wait_seconds(20.0) == pytest.approx(STOP_GRACE_SECONDS + STOP_WAIT_SECONDS)
    assert t.due(deadline - 0.001) is Due.NOTHING
    assert t.due(deadline) is Due.KILL_UNSTOPPED


def test_a_kill_that_does_not_end_the_output_is_repeated() -> None:
    t = timers(hard=20.0, idle=10.0)
    t.on_stop_requested(20.0)
    first = 20.0 + STOP_GRACE_SECONDS + STOP_WAIT_SECONDS
    t.on_kill_sent(first)
    assert t.due(first + STOP_WAIT_SECONDS - 0.001) is Due.NOTHING
    assert t.due(first + STOP_WAIT_SECONDS) is Due.KILL_UNSTOPPED
    t.on_kill_sent(first + STOP_WAIT_SECONDS)
    assert t.wait_seconds(first + STOP_WAIT_SECONDS) == STOP_WAIT_SECONDS
    assert t.timed_out  # a kill does not undo the timeout


def test_while_stopping_neither_output_nor_follow_ups_nor_idle_matter() -> None:
    t = timers(hard=20.0, idle=10.0)
    t.on_stop_requested(20.0)
    t.on_block(21.0)
    t.on_touch(22.0)
    deadline = 20.0 + STOP_GRACE_SECONDS + STOP_WAIT_SECONDS
    assert t.next_deadline() == deadline  # not postponed by the block
    assert t.due(21.0 + IDLE) is Due.NOTHING  # never an idle close while stopping
    assert not t.closed
    assert t.due(deadline) is Due.KILL_UNSTOPPED


def test_the_start_restarts_both_timers_and_forgets_earlier_touches() -> None:
    t = timers(now=0.0)
    t.on_touch(3.0)  # a follow-up while the engine was still starting the container
    t.on_started(7.0)
    assert (t.last_block, t.last_activity) == (7.0, 7.0)
    assert t.due(7.0 + IDLE - 0.001) is Due.NOTHING
    assert t.due(7.0 + IDLE) is Due.CLOSE_IDLE


def test_a_close_before_the_start_is_kept() -> None:
    t = timers()
    t.on_close()
    t.on_started(2.0)
    assert t.closed and t.next_deadline() == 2.0 + HARD


@pytest.mark.parametrize(("hard", "idle", "expected"), [
    (100.0, 10.0, 10.0),  # shorter idle timer: as configured
    (100.0, 99.9, 99.9),
    (100.0, 100.0, 80.0),  # equal: clamped
    (60.0, 600.0, 48.0),  # a short group/per-run timeout under the global idle timeout
    (2.0, 1800.0, 1.6),
])
def test_an_idle_timer_at_or_above_the_hard_timer_is_clamped_to_four_fifths(
        hard: float, idle: float, expected: float) -> None:
    t = RunTimers(hard, idle, 0.0)
    assert t.hard == hard
    assert t.idle == pytest.approx(expected)
    assert t.due(t.idle) is Due.CLOSE_IDLE  # the conversation closes before the hard stop
    assert t.due(hard) is Due.STOP_HARD


def test_wait_seconds_is_never_negative() -> None:
    t = timers()
    assert t.wait_seconds(1000.0) == 0.0
    t.on_stop_requested(5.0)
    assert t.wait_seconds(1000.0) == 0.0


# --------------------------------------------------------------------------- the oracle


class LoopBeforeTheSplit:
    """The decisions of `ContainerRunner._run`'s hand-written loop before `RunTimers`, copied
    expression for expression (I/O left out): what the split must keep doing."""

    def __init__(self, hard: float, idle: float, now: float) -> None:
        if idle >= hard:
            idle = hard * 0.8
        self.hard, self.idle = hard, idle
        self.timed_out = self.stopping = self.closed = False
        self.stop_deadline = 0.0
        self.last_block = self.last_activity = now

    def step(self, now: float) -> tuple[str, float]:
        """One pass of the loop: ("kill"|"stop"|"close", 0) after acting, or ("wait", s)."""
        hard_left = self.last_block + self.hard - now
        idle_left = self.last_activity + self.idle - now
        wait = hard_left if (self.closed or self.stopping) else min(hard_left, idle_left)
        if self.stopping:
            wait = self.stop_deadline - now
            if wait <= 0:
                self.stop_deadline = now + 30.0
                return "kill", 0.0
        if wait <= 0:
            if not self.stopping and hard_left <= 0:
                self.timed_out = True
                self.stopping = True
                self.stop_deadline = now + STOP_GRACE_SECONDS + 30.0
                return "stop", 0.0
            if not self.closed and idle_left <= 0:
                self.closed = True
                return "close", 0.0
        return "wait", max(wait, 0.0)


def step_timers(t: RunTimers, now: float) -> tuple[str, float]:
    """One pass of `_RunLoop.until_eof` over `t`, its actions reduced to their state."""
    due = t.due(now)
    if due is Due.KILL_UNSTOPPED:
        t.on_kill_sent(now)
        return "kill", 0.0
    if due is Due.STOP_HARD:
        t.on_stop_requested(now)
        return "stop", 0.0
    if due is Due.CLOSE_IDLE:
        t.on_close()
        return "close", 0.0
    return "wait", t.wait_seconds(now)


EVENTS = st.lists(st.tuples(
    st.sampled_from(["advance", "block", "touch", "close"]),
    st.floats(min_value=0.0, max_value=120.0, allow_nan=False)), max_size=40)


@settings(max_examples=400, deadline=None)
@given(hard=st.floats(min_value=0.5, max_value=3600.0),
       idle=st.floats(min_value=0.1, max_value=7200.0),
       start=st.floats(min_value=0.0, max_value=1e6), events=EVENTS)
def test_the_timers_decide_exactly_as_the_loop_before_the_split(
        hard: float, idle: float, start: float, events: list[tuple[str, float]]) -> None:
    old, new = LoopBeforeTheSplit(hard, idle, start), RunTimers(hard, idle, start)
    now = start
    for kind, dt in [("advance", 0.0), *events]:
        if kind == "advance":
            now += dt
        elif kind == "block":
            old.last_block = old.last_activity = now
            new.on_block(now)
        elif kind == "touch":
            old.last_activity = now
            new.on_touch(now)
        elif kind == "close":  # the orchestrator closing the conversation
            old.closed = True
            new.on_close()
        for _ in range(10):  # act until the loop would wait, as it does
            a, b = old.step(now), step_timers(new, now)
            assert a == b, (kind, now)
            if a[0] == "wait":
                assert a[1] > 0.0
                break
        else:
            pytest.fail("the loop never came to wait")
        assert (new.closed, new.timed_out) == (old.closed, old.timed_out)


# --------------------------------------------------------------------------- the loop

GROUP = "fam"


def block(text: str) -> bytes:
    return f"{OUTPUT_START}\n{text}\n{OUTPUT_END}\n".encode()


class FakeContainer(RunningContainer):
    """A container whose output is whatever its script (a thread) writes."""

    def __init__(self, cid: str, name: str, *, stuck: bool = False) -> None:
        self.id = cid
        self.name = name
        self.stuck = stuck  # close() does not end the stream (an engine that hangs)
        self.exit_code = 0
        self.closed = threading.Event()
        self.ended = threading.Event()
        self._out: queue.Queue[tuple[int, bytes] | None] = queue.Queue()

    def say(self, text: str) -> None:
        self._out.put((STDOUT, block(text)))

    def stderr(self, data: bytes) -> None:
        self._out.put((STDERR, data))

    def end(self, code: int) -> None:
        if not self.ended.is_set():
            self.exit_code = code
            self.ended.set()
            self._out.put(None)

    def chunks(self) -> Iterator[tuple[int, bytes]]:  # type: ignore[override]
        while (item := self._out.get()) is not None:
            yield item

    def wait(self, timeout: float | None = None) -> int:
        return self.exit_code

    def close(self) -> None:
        self.closed.set()
        if not self.stuck:
            self._out.put(None)


Script = Callable[[FakeContainer], None]


class FakeRuntime(ContainerRuntime):
    """Starts `FakeContainer`s running `script`; records stop/kill/remove.

    `obeys_stop`: a stop ends the container (exit 143); `kills_needed`: how many kills it
    takes to end it (exit 137); `kill_error`: raised by kill(); `stuck`: releasing the
    container's stream does not end it.
    """

    engine = "fake"
    description = "fake"

    def __init__(self, script: Script, *, obeys_stop: bool = True, kills_needed: int = 1,
                 kill_error: BaseException | None = None, stuck: bool = False) -> None:
        self.script = script
        self.stuck = stuck
        self.obeys_stop = obeys_stop
        self.kills_needed = kills_needed
        self.kill_error = kill_error
        self.calls: list[str] = []
        self.container: FakeContainer | None = None
        self.started = threading.Event()

    def start(self, spec: RunSpec) -> RunningContainer:
        c = self.container = FakeContainer("c0ffee" * 4, spec.name, stuck=self.stuck)
        threading.Thread(target=self.script, args=(c,), daemon=True).start()
        self.started.set()
        return c

    def stop(self, container_id: str, grace: float = 2.0) -> None:
        self.calls.append(f"stop {grace:g}")
        if self.obeys_stop and self.container:
            self.container.end(143)

    def kill(self, container_id: str) -> None:
        self.calls.append("kill")
        if self.kill_error is not None:
            raise self.kill_error
        if self.calls.count("kill") >= self.kills_needed and self.container:
            self.container.end(137)

    def remove(self, container_id: str) -> None:
        self.calls.append("remove")

    def ping(self) -> str:
        return "fake"

    def image_info(self, ref: str) -> ImageInfo | None:
        return None

    def build_image(self, tag: str, dockerfile: Path, context: Path, progress=None,
                    build_args=None) -> str:
        raise NotImplementedError

    def load_image(self, tarball: Path, progress=None) -> list[str]:
        raise NotImplementedError

    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        return []


def make_runner(tmp_path: Path, runtime: FakeRuntime, *, idle: str = "10m") -> ContainerRunner:
    cfg = Config(data_dir=tmp_path / "data", groups={
        "main": {"name": "A", "jid": "tg:1", "main": True},
        GROUP: {"name": "F", "jid": "tg:2"}},
                 limits={"idle_timeout": idle, "container_timeout": "30m"})
    return ContainerRunner(cfg, runtime)


def close_file(runner: ContainerRunner) -> Path:
    return runner.layout.group_ipc_dir(GROUP) / "input" / CLOSE_SENTINEL


def until(cond: Callable[[], bool], limit: float = 10.0) -> bool:
    """Whether `cond` came true within `limit` s, for a script thread (the container's side:
    a miss becomes its exit code, which the test asserts)."""
    try:
        wait_until(cond, limit)
    except AssertionError:
        return False
    return True


RUN_LIMIT = 20.0  # seconds: a broken timer fails a test instead of hanging it


async def run_and_clean(runner: ContainerRunner, **kw):
    try:
        return await asyncio.wait_for(
            runner.run(GROUP, ContainerInput("hi", GROUP, "tg:2"), **kw), RUN_LIMIT)
    finally:
        await runner.aclose()


def test_each_block_reaches_the_callback_and_a_failing_callback_is_logged_and_survived(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def script(c: FakeContainer) -> None:
        for text in ("one", "two", "three"):
            c.say(text)
        c.stderr(b"some noise\n")
        c.end(0)

    seen: list[str] = []

    async def on_output(text: str) -> None:
        seen.append(text)
        if text == "two":
            raise ValueError("the channel is down")

    rt = FakeRuntime(script)
    runner = make_runner(tmp_path, rt)
    with caplog.at_level(logging.INFO, logger="mdclaw.runner"):
        res = asyncio.run(run_and_clean(runner, on_output=on_output))
    assert seen == ["one", "two", "three"]
    assert res.outputs == ["one", "two", "three"] and res.output == "three"
    assert (res.status, res.exit_code, res.error) == ("success", 0, None)
    assert not res.timed_out and not res.closed_idle
    assert res.stderr_tail == "some noise\n" and res.stdout_bytes > 0
    failed = [r for r in caplog.records if r.getMessage().startswith("output callback for")]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert failed[0].exc_info[0] is ValueError
    assert rt.calls == ["remove"]
    assert runner.active(GROUP) is None


def test_a_plain_function_callback_is_called_too(tmp_path: Path) -> None:
    def script(c: FakeContainer) -> None:
        c.say("only")
        c.end(3)

    seen: list[str] = []
    rt = FakeRuntime(script)
    res = asyncio.run(run_and_clean(make_runner(tmp_path, rt), on_output=seen.append))
    assert seen == ["only"]
    assert (res.status, res.exit_code) == ("error", 3)
    assert res.error == "container exited with status 3"


def test_the_result_has_every_mark_and_timing(tmp_path: Path) -> None:
    def script(c: FakeContainer) -> None:
        c.say("x")
        c.end(0)

    res = asyncio.run(run_and_clean(make_runner(tmp_path, FakeRuntime(script))))
    assert list(res.marks) == ["call", "start_call", "started", "eof", "wait_call", "waited",
                               "done"]
    m = list(res.marks.values())
    assert m == sorted(m)  # in the order they happen
    assert set(res.timings) == {"prepare_ms", "engine_start_ms", "exit_to_result_ms",
                                "exit_status_ms"}
    assert res.timings["prepare_ms"] == pytest.approx(
        (res.marks["start_call"] - res.marks["call"]) * 1000)
    assert res.timings["exit_to_result_ms"] == pytest.approx(
        (res.marks["done"] - res.marks["eof"]) * 1000)
    assert all(v >= 0 for v in res.timings.values())


def test_the_idle_timer_writes_close_and_the_result_says_closed_idle(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def script(c: FakeContainer) -> None:
        c.say("answer")
        c.end(0 if until(close_file(runner).exists) else 9)

    rt = FakeRuntime(script)
    runner = make_runner(tmp_path, rt, idle="200ms")
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="mdclaw.runner"):
        res = asyncio.run(run_and_clean(runner))
    assert time.monotonic() - t0 >= 0.2
    assert res.status == "success" and res.closed_idle and not res.timed_out
    assert res.outputs == ["answer"]
    assert any("idle for 0 s, writing _close" in r.getMessage() for r in caplog.records)
    assert "stop 2" not in rt.calls and "kill" not in rt.calls


async def started(runner: ContainerRunner):
    """The group's handle once its container has started."""
    def handle():
        h = runner.active(GROUP)
        return h if h is not None and h.container_id is not None else None

    return await wait_until_async(handle, RUN_LIMIT, interval=0.005,
                                  what="the container to start")


def test_a_follow_up_postpones_the_idle_close(tmp_path: Path) -> None:
    """touch() three times, 500 ms apart, under a 2 s idle timer: _close comes 2 s after
    the last one, not 2 s after the output. (Each touch comes 1.5 s before the timer would
    fire: room for a loaded machine.)"""
    def script(c: FakeContainer) -> None:
        c.say("answer")
        c.end(0 if until(close_file(runner).exists) else 9)

    runner = make_runner(tmp_path, FakeRuntime(script), idle="2s")

    async def main():
        task = asyncio.ensure_future(run_and_clean(runner))
        handle = await started(runner)
        for _ in range(3):
            await asyncio.sleep(0.5)
            assert not close_file(runner).exists()
            handle.touch()
        return await task

    res = asyncio.run(main())
    assert res.closed_idle and res.status == "success"
    # marks are perf_counter values: the output ended (after _close) >= 1.5 + 2 s in
    assert res.marks["eof"] - res.marks["started"] >= 3.45


def test_a_close_from_the_orchestrator_ends_the_run_before_the_idle_timer(
        tmp_path: Path) -> None:
    def script(c: FakeContainer) -> None:
        c.say("answer")
        c.end(0 if until(close_file(runner).exists) else 9)

    runner = make_runner(tmp_path, FakeRuntime(script), idle="5s")

    async def main():
        task = asyncio.ensure_future(run_and_clean(runner))
        (await started(runner)).close()
        return await task

    t0 = time.monotonic()
    res = asyncio.run(main())
    assert time.monotonic() - t0 < 4.0  # ended by our _close, not the idle timer
    assert res.closed_idle and res.status == "success"


@pytest.fixture
def short_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "STOP_GRACE_SECONDS", 0.05)
    monkeypatch.setattr(runner_mod, "STOP_WAIT_SECONDS", 0.2)


def test_the_hard_timer_stops_a_silent_container(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, short_stops: None) -> None:
    def script(c: FakeContainer) -> None:
        c.say("thinking")  # then silence; the follow-ups below are not output

    rt = FakeRuntime(script)
    runner = make_runner(tmp_path, rt)

    async def main():
        task = asyncio.ensure_future(run_and_clean(runner, timeout=0.6))
        handle = await started(runner)
        for _ in range(50):  # a follow-up every 100 ms keeps the idle timer off...
            if task.done():
                break
            handle.touch()
            await asyncio.sleep(0.1)
        return await asyncio.wait_for(task, 10)

    with caplog.at_level(logging.INFO, logger="mdclaw.runner"):
        res = asyncio.run(main())
    # ...but not the hard timer
    assert (res.status, res.timed_out, res.exit_code) == ("timeout", True, 143)
    assert res.error is None  # a timeout is its own status, not an error exit
    assert res.outputs == ["thinking"] and not res.closed_idle
    assert rt.calls == ["stop 0.05", "remove"]
    assert any("no output for 1 s, stopping it (hard timeout)" in r.getMessage()
               for r in caplog.records)


def test_output_keeps_a_container_past_its_hard_timeout(tmp_path: Path) -> None:
    # A block every 0.4 s under a 2 s hard timer, for 2.8 s in all: each block comes 1.6 s
    # before the timer would fire (room for a loaded machine), and the run outlives it.
    def script(c: FakeContainer) -> None:
        for i in range(8):
            c.say(str(i))
            if i < 7:
                time.sleep(0.4)
        c.end(0)

    rt = FakeRuntime(script)
    res = asyncio.run(run_and_clean(make_runner(tmp_path, rt), timeout=2.0))
    assert res.status == "success" and not res.timed_out
    assert res.outputs == [str(i) for i in range(8)]
    assert "stop 2" not in rt.calls


def test_a_container_that_ignores_its_stop_is_killed_again_until_it_ends(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, short_stops: None) -> None:
    rt = FakeRuntime(lambda c: None, obeys_stop=False, kills_needed=2, stuck=True)
    runner = make_runner(tmp_path, rt)
    with caplog.at_level(logging.INFO, logger="mdclaw.runner"):
        res = asyncio.run(run_and_clean(runner, timeout=0.2))
    assert (res.status, res.timed_out) == ("timeout", True)
    assert rt.calls == ["stop 0.05", "kill", "kill", "remove"]
    assert rt.container is not None and rt.container.closed.is_set()
    kills = [r for r in caplog.records if "did not stop; killing it" in r.getMessage()]
    assert len(kills) == 2 and all(r.levelno == logging.ERROR for r in kills)


def test_a_failing_kill_is_logged_and_the_stream_is_released(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, short_stops: None) -> None:
    rt = FakeRuntime(lambda c: None, obeys_stop=False,
                     kill_error=EngineUnavailable("engine went away"))
    with caplog.at_level(logging.INFO, logger="mdclaw.runner"):
        res = asyncio.run(run_and_clean(make_runner(tmp_path, rt), timeout=0.2))
    # running.close() ended the output, so the run ends instead of hanging
    assert res.timed_out and rt.calls[:2] == ["stop 0.05", "kill"]
    assert any("could not kill container" in r.getMessage() and "engine went away"
               in r.getMessage() for r in caplog.records)


def test_cancelling_a_run_kills_and_removes_its_container(tmp_path: Path) -> None:
    rt = FakeRuntime(lambda c: c.say("working"))
    runner = make_runner(tmp_path, rt)

    async def main():
        seen = asyncio.Event()
        task = asyncio.ensure_future(run_and_clean(runner, on_output=lambda _: seen.set()))
        await asyncio.wait_for(seen.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await runner.aclose()

    asyncio.run(main())
    assert rt.calls == ["kill", "remove"]
    assert rt.container is not None and rt.container.closed.is_set()
    assert runner.active(GROUP) is None


# --------------------------------------------------------------------------- engine errors


class Refusing(FakeRuntime):
    def __init__(self, error: BaseException) -> None:
        super().__init__(lambda c: None)
        self.error = error

    def kill(self, container_id: str) -> None:
        raise self.error

    def remove(self, container_id: str) -> None:
        raise self.error


@pytest.mark.parametrize("error", [
    EngineCallError("no such container"), EngineUnavailable("socket gone"),
    TimeoutError("read timed out"),  # an OSError, as the docker SDK's request errors are
])
def test_kill_and_remove_quietly_log_engine_errors(
        error: BaseException, caplog: pytest.LogCaptureFixture) -> None:
    rt = Refusing(error)
    with caplog.at_level(logging.WARNING, logger="mdclaw.runner"):
        _kill_quietly(rt, "abcdef0123456789")
        _remove_quietly(rt, "abcdef0123456789")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [f"could not kill container abcdef012345: {error}",
                    f"could not remove container abcdef012345: {error}"]


def test_kill_and_remove_quietly_let_a_programming_error_through() -> None:
    rt = Refusing(TypeError("bad argument"))
    with pytest.raises(TypeError):
        _kill_quietly(rt, "abcdef0123456789")
    with pytest.raises(TypeError):
        _remove_quietly(rt, "abcdef0123456789")
