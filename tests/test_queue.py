"""The per-group queue on a real event loop; jobs are small coroutines that record what ran."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from mdclaw.queue import GroupQueue, Job
from waiting import wait_until_async


class Recorder:
    """A run_job that records start/end order and concurrency; jobs named in `fail` raise."""

    def __init__(self, duration: float = 0.02, fail: dict[str, int] | None = None) -> None:
        self.duration = duration
        self.fail = dict(fail or {})  # job id -> how many times it fails before succeeding
        self.started: list[tuple[str, str]] = []
        self.running: set[str] = set()
        self.groups_running: set[str] = set()
        self.peak = 0
        self.overlap: list[str] = []
        self.attempt_times: dict[str, list[float]] = {}

    async def __call__(self, job: Job) -> None:
        if job.group in self.groups_running:
            self.overlap.append(job.group)
        self.groups_running.add(job.group)
        self.running.add(job.id)
        self.peak = max(self.peak, len(self.running))
        self.started.append((job.group, job.id))
        self.attempt_times.setdefault(job.id, []).append(time.monotonic())
        try:
            await asyncio.sleep(self.duration)
            if self.fail.get(job.id, 0) > 0:
                self.fail[job.id] -= 1
                raise RuntimeError(f"boom {job.id}")
        finally:
            self.running.discard(job.id)
            self.groups_running.discard(job.group)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_one_job_per_group_and_the_global_cap() -> None:
    rec = Recorder(duration=0.03)

    async def go():
        q = GroupQueue(rec, max_concurrent=3)
        for g in range(6):
            for i in range(3):
                q.enqueue_message(f"g{g}", job_id=f"g{g}-m{i}")
        await q.join()
        return q

    q = run(go())
    assert len(rec.started) == 18
    assert rec.overlap == []
    assert rec.peak == 3 and q.peak_running == 3


def test_fifo_within_a_group_and_tasks_before_messages() -> None:
    rec = Recorder()

    async def go():
        q = GroupQueue(rec, max_concurrent=1)
        q.enqueue_message("a", job_id="m1")  # starts at once (the queue is empty)
        q.enqueue_message("a", job_id="m2")
        q.enqueue_message("a", job_id="m3")
        q.enqueue_task("a", "t1")
        q.enqueue_task("a", "t2")
        await q.join()

    run(go())
    assert [i for _, i in rec.started] == ["m1", "t1", "t2", "m2", "m3"]


def test_groups_with_a_task_waiting_get_the_free_slot_first() -> None:
    rec = Recorder()

    async def go():
        q = GroupQueue(rec, max_concurrent=1)
        q.enqueue_message("busy", job_id="first")
        q.enqueue_message("b", job_id="b-msg")
        q.enqueue_task("c", "c-task")
        await q.join()

    run(go())
    assert [i for _, i in rec.started] == ["first", "c-task", "b-msg"]


def test_a_task_id_is_never_queued_or_run_twice_at_once() -> None:
    rec = Recorder(duration=0.05)

    async def go():
        q = GroupQueue(rec, max_concurrent=2)
        assert q.enqueue_task("a", "daily") is True
        assert q.enqueue_task("a", "daily") is False  # running
        assert q.enqueue_task("b", "daily") is False  # same task id, any group
        assert q.enqueue_task("a", "other") is True
        assert q.enqueue_task("a", "other") is False  # queued
        await q.join()
        assert q.enqueue_task("a", "daily") is True  # finished: may run again
        await q.join()

    run(go())
    assert [i for _, i in rec.started] == ["daily", "other", "daily"]


def test_retries_with_exponential_backoff_then_success() -> None:
    rec = Recorder(duration=0.0, fail={"t": 2})

    async def go():
        q = GroupQueue(rec, max_concurrent=1, retry_base=0.1, retry_jitter=0)
        q.enqueue_task("a", "t")
        await q.join()
        return q

    q = run(go())
    times = rec.attempt_times["t"]
    assert len(times) == 3
    assert times[1] - times[0] >= 0.09
    assert times[2] - times[1] >= 0.19  # doubled
    assert q.failures == []


def test_after_five_tries_the_failure_is_recorded_and_reported() -> None:
    rec = Recorder(duration=0.0, fail={"t": 99})
    told: list[tuple[str, str]] = []

    async def tell(job: Job, err: BaseException) -> None:
        told.append((job.id, str(err)))

    async def go():
        q = GroupQueue(rec, max_concurrent=1, retry_base=0.01, on_failure=tell)
        q.enqueue_task("a", "t")
        await q.join()
        return q

    q = run(go())
    assert len(rec.attempt_times["t"]) == 5
    assert told == [("t", "boom t")]
    assert len(q.failures) == 1 and q.failures[0].job.attempts == 5
    assert "boom t" in q.failures[0].error


def test_retry_delays_are_jittered_doubling_and_capped() -> None:
    rec = Recorder(duration=0.0, fail={"t": 99})
    delays: list[float] = []

    async def go():
        q = GroupQueue(rec, max_concurrent=1, max_attempts=6, retry_base=0.004,
                       retry_cap=0.02, rng=random.Random(5),
                       on_retry=lambda job, e, delay: delays.append(delay))
        q.enqueue_task("a", "t")
        await q.join()

    run(go())
    nominal = [0.004, 0.008, 0.016, 0.02, 0.02]  # doubling, then the cap
    assert len(delays) == len(nominal)
    assert all(n / 2 <= d <= n for d, n in zip(delays, nominal, strict=True))
    assert delays != nominal  # the default is jittered
    assert GroupQueue(rec, max_concurrent=1, retry_base=900, retry_cap=600,
                      retry_jitter=0).backoff.delay(1) == 900  # the cap never cuts the base


def test_a_retrying_job_keeps_its_group_order_and_does_not_block_others() -> None:
    rec = Recorder(duration=0.0, fail={"m1": 1})

    async def go():
        q = GroupQueue(rec, max_concurrent=2, retry_base=1.0, retry_jitter=0)
        q.enqueue_message("a", job_id="m1")
        q.enqueue_message("a", job_id="m2")
        await wait_until_async(lambda: q.status()["retrying"] == ["a"])
        q.enqueue_message("b", job_id="b1")  # runs while a waits for its retry
        await q.join()

    run(go())
    order = [i for _, i in rec.started]
    assert order == ["m1", "b1", "m1", "m2"]


def test_shutdown_drains_running_jobs_and_returns_the_rest() -> None:
    rec = Recorder(duration=0.2)

    async def go():
        q = GroupQueue(rec, max_concurrent=1)
        q.enqueue_message("a", job_id="m1")
        q.enqueue_message("a", job_id="m2")
        q.enqueue_task("b", "t1")
        await wait_until_async(lambda: rec.started)
        left = await q.shutdown(grace=5)
        assert q.enqueue_message("a", job_id="late") is False
        return left

    left = run(go())
    assert [i for _, i in rec.started] == ["m1"]  # finished inside the grace period
    assert sorted(j.id for j in left) == ["m2", "t1"]


def test_shutdown_cancels_jobs_that_outlive_the_grace() -> None:
    cancelled: list[str] = []
    entered: list[str] = []

    async def slow(job: Job) -> None:
        entered.append(job.id)
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(job.id)
            raise

    async def go():
        q = GroupQueue(slow, max_concurrent=2)
        q.enqueue_message("a", job_id="m1")
        q.enqueue_message("b", job_id="m2")
        await wait_until_async(lambda: len(entered) == 2)
        t0 = time.monotonic()
        left = await q.shutdown(grace=0.2)
        assert time.monotonic() - t0 < 2
        return left

    left = run(go())
    assert sorted(cancelled) == ["m1", "m2"]
    assert sorted(j.id for j in left) == ["m1", "m2"]


def test_shutdown_cancels_pending_retries() -> None:
    rec = Recorder(duration=0.0, fail={"t": 99})

    async def go():
        q = GroupQueue(rec, max_concurrent=1, retry_base=30)
        q.enqueue_task("a", "t")
        await wait_until_async(lambda: q.status()["retrying"])
        assert q.status()["retrying"] == ["a"]
        return await q.shutdown(grace=1)

    left = run(go())
    assert [j.id for j in left] == ["t"] and len(rec.attempt_times["t"]) == 1


def test_bad_settings_are_refused() -> None:
    async def nothing(job: Job) -> None:
        return None

    with pytest.raises(ValueError):
        GroupQueue(nothing, max_concurrent=0)


def test_permanent_error_is_not_retried() -> None:
    from mdclaw.queue import GroupQueue
    from mdclaw.runtime import ImageError

    calls: list[str] = []
    failed: list[str] = []

    async def run_job(job) -> None:  # noqa: ANN001
        calls.append(job.id)
        raise ImageError("image mdclaw-agent:latest not found")

    async def main() -> None:
        q = GroupQueue(run_job, max_concurrent=2, max_attempts=5, retry_base=0.01,
                       on_failure=lambda job, e: failed.append(str(e)))
        q.enqueue_message("g", job_id="m1")
        await asyncio.wait_for(q.join(), 5)

    asyncio.run(main())
    assert calls == ["m1"]
    assert failed == ["image mdclaw-agent:latest not found"]


def test_errors_choose_their_tries_and_wait_and_retries_are_reported() -> None:
    class Flaky(RuntimeError):
        def __init__(self, max_tries=None, retry_delay=None) -> None:  # noqa: ANN001
            super().__init__("flaky")
            self.max_tries = max_tries
            self.retry_delay = retry_delay

    times: list[float] = []
    retries: list[tuple[int, float]] = []
    failed: list[int] = []
    errors = iter([Flaky(retry_delay=0.3), Flaky(max_tries=2), Flaky(max_tries=2)])

    async def run_job(job) -> None:  # noqa: ANN001
        times.append(time.monotonic())
        raise next(errors)

    async def main() -> None:
        q = GroupQueue(run_job, max_concurrent=1, max_attempts=5, retry_base=0.01,
                       on_retry=lambda job, e, delay: retries.append((job.attempts, delay)),
                       on_failure=lambda job, e: failed.append(job.attempts))
        q.enqueue_message("g", job_id="m1")
        await asyncio.wait_for(q.join(), 5)

    asyncio.run(main())
    # The first error asked for 0.3 s (more than the 0.01 s backoff); the second allows two
    # tries in all, so there is no third.
    assert retries == [(1, 0.3)]
    assert failed == [2] and len(times) == 2
    assert times[1] - times[0] >= 0.29


def test_a_message_waiting_to_retry_does_not_hold_up_a_task_of_its_group() -> None:
    order: list[str] = []
    task_ran = asyncio.Event()

    async def run(job: Job) -> None:
        order.append(job.id)
        if job.id == "m" and order.count("m") == 1:
            raise RuntimeError("model away")
        if job.kind == "task":
            task_ran.set()

    async def main() -> None:
        q = GroupQueue(run, max_concurrent=2, retry_base=30.0, retry_jitter=0.0)
        q.enqueue_message("g", job_id="m")
        await wait_until_async(lambda: "g" in q.status()["retrying"])
        q.enqueue_task("g", "t")
        await asyncio.wait_for(task_ran.wait(), 2)  # not after the 30 s backoff
        assert q.pending("g")[0].id == "m"  # the message keeps its place
        await q.shutdown(1)

    asyncio.run(main())
    assert order == ["m", "t"]


def test_new_limits_apply_to_waiting_jobs_and_the_next_failure() -> None:
    """configure() (a config reload): a raised cap starts waiting jobs at once, without
    waiting for a running one to end; the next failure is retried by the new tries."""
    gate = asyncio.Event()
    started: list[str] = []
    tries: dict[str, int] = {}

    async def job(j: Job) -> None:
        started.append(j.id)
        tries[j.id] = tries.get(j.id, 0) + 1
        if j.id == "flaky":
            raise RuntimeError("down")
        await gate.wait()

    async def go() -> GroupQueue:
        q = GroupQueue(job, max_concurrent=1, max_attempts=5, retry_base=0.001,
                       retry_jitter=0)
        for g in "abc":
            q.enqueue_message(g, job_id=g)
        await wait_until_async(lambda: started == ["a"])
        q.configure(max_concurrent=4, max_attempts=2, retry_base=0.001)
        await wait_until_async(lambda: sorted(started) == ["a", "b", "c"])  # "a" still runs
        assert q.status()["max_concurrent"] == 4
        q.enqueue_message("d", job_id="flaky")  # the fourth slot
        await wait_until_async(lambda: len(q.failures) == 1)
        gate.set()
        await q.join()
        return q

    q = run(go())
    assert tries["flaky"] == 2  # the new max_attempts, not the 5 it was made with
    with pytest.raises(ValueError):
        q.configure(max_concurrent=0, max_attempts=1, retry_base=0)
