"""mdclaw.retry: the backoff every retry of the host uses, and its stoppable wait."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdclaw.retry import EQUAL_JITTER, FULL_JITTER, NO_JITTER, Backoff, wait


def test_without_jitter_the_delays_grow_by_the_factor_up_to_the_cap() -> None:
    b = Backoff(base=2, factor=2, cap=10, jitter=NO_JITTER)
    assert [b.delay(n) for n in range(1, 7)] == [2, 4, 8, 10, 10, 10]
    assert b.delay(0) == b.delay(-3) == 2  # "no failure yet" waits the base
    assert [Backoff(base=5, factor=3, cap=600, jitter=0).delay(n)
            for n in (1, 2, 3, 4, 5)] == [5, 15, 45, 135, 405]


def test_very_many_attempts_give_the_cap_not_an_overflow() -> None:
    b = Backoff(base=1, factor=2, cap=60)
    assert b.nominal(100_000) == 60.0
    assert 30.0 <= b.delay(10**9) <= 60.0
    assert Backoff(base=0, cap=60).delay(10**9) == 0.0


@given(base=st.floats(0, 1e6), factor=st.floats(1, 100), cap=st.floats(0, 1e7),
       jitter=st.floats(0, 1), attempt=st.integers(-5, 10_000), seed=st.integers(0, 2**32))
def test_a_delay_is_never_negative_never_above_the_cap_and_keeps_its_fixed_share(
        base: float, factor: float, cap: float, jitter: float, attempt: int,
        seed: int) -> None:
    b = Backoff(base=base, factor=factor, cap=cap, jitter=jitter, rng=random.Random(seed))
    nominal = b.nominal(attempt)
    d = b.delay(attempt)
    assert 0.0 <= d <= nominal <= cap
    assert d >= (1.0 - jitter) * nominal * (1 - 1e-12)


@given(base=st.floats(0.001, 1e3), factor=st.floats(1, 10), cap=st.floats(0, 1e5))
def test_nominal_delays_grow_until_the_cap_and_then_stay_there(
        base: float, factor: float, cap: float) -> None:
    b = Backoff(base=base, factor=factor, cap=cap)
    delays = [b.nominal(n) for n in range(1, 200)]
    assert all(x <= y for x, y in zip(delays, delays[1:], strict=False))
    if factor >= 1.1:
        assert delays[-1] == cap or base * factor ** 198 <= cap


def test_equal_jitter_spreads_over_the_upper_half() -> None:
    b = Backoff(base=1, factor=2, cap=60, jitter=EQUAL_JITTER, rng=random.Random(7))
    samples = [b.delay(3) for _ in range(2000)]  # nominal 4 s
    assert all(2.0 <= s <= 4.0 for s in samples)
    assert min(samples) < 2.1 and max(samples) > 3.9
    assert statistics.mean(samples) == pytest.approx(3.0, abs=0.1)
    assert len(set(samples)) > 1900  # not a handful of values


def test_full_jitter_spreads_over_the_whole_range() -> None:
    b = Backoff(base=10, factor=2, cap=60, jitter=FULL_JITTER, rng=random.Random(7))
    samples = [b.delay(1) for _ in range(2000)]
    assert all(0.0 <= s <= 10.0 for s in samples)
    assert min(samples) < 0.1 and max(samples) > 9.9


def test_the_same_seed_gives_the_same_delays() -> None:
    def run(seed: int) -> list[float]:
        b = Backoff(base=1, factor=2, cap=60, rng=random.Random(seed))
        return [b.delay(n) for n in range(1, 10)]

    assert run(3) == run(3) != run(4)


@pytest.mark.parametrize("kw", [dict(base=-1), dict(factor=0.5), dict(cap=-1),
                                dict(jitter=1.5), dict(jitter=-0.1), dict(base=math.nan),
                                dict(cap=math.nan)])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        Backoff(**kw)


# ------------------------------------------------------------------ wait


def test_wait_returns_as_soon_as_the_stop_event_is_set() -> None:
    async def go() -> tuple[bool, float]:
        stop = asyncio.Event()
        t0 = time.monotonic()
        waiting = asyncio.create_task(wait(3600, stop))
        await asyncio.sleep(0)  # one loop step: the task is now blocked on the event
        assert not waiting.done()
        stop.set()
        stopped = await asyncio.wait_for(waiting, 5)
        return stopped, time.monotonic() - t0

    stopped, took = asyncio.run(go())
    assert stopped is True and took < 1


def test_wait_with_the_event_already_set_does_not_sleep() -> None:
    async def go() -> bool:
        stop = asyncio.Event()
        stop.set()
        return await asyncio.wait_for(wait(3600, stop), 1)

    assert asyncio.run(go()) is True


def test_wait_runs_its_time_when_nothing_stops_it() -> None:
    async def go() -> tuple[bool, bool, float]:
        t0 = time.monotonic()
        a = await wait(0.05, asyncio.Event())
        b = await wait(0.05)
        return a, b, time.monotonic() - t0

    a, b, took = asyncio.run(go())
    assert a is False and b is False and took >= 0.09


def test_a_cancelled_wait_is_cancelled_not_stopped() -> None:
    async def go() -> None:
        waiting = asyncio.create_task(wait(3600, asyncio.Event()))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(go())
