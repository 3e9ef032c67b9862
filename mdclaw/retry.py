"""One way to wait between tries: exponential backoff, capped, with jitter.

Every retry of the host takes its waits from a `Backoff`: the outbox's deliveries
(`mdclaw.outbox.RetryPolicy`), the run queue's retries (`mdclaw.queue`), the Telegram poll
loop and the wait for the container engine (`mdclaw.runtime.wait_for_engine`). Retries kept
in the database only need `Backoff.delay`; loops in the process sleep with `wait`, which a
stop event cuts short.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

NO_JITTER = 0.0
EQUAL_JITTER = 0.5
FULL_JITTER = 1.0


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait after the n-th failed try: `base * factor**(n-1)`, at most `cap`,
    shortened at random by up to `jitter` of itself.

    `jitter` is the random share of the wait: the delay is drawn uniformly from
    [(1 - jitter) * d, d] where d is the nominal delay, so it is never above the cap and
    never negative. The default is "equal jitter" (0.5: half fixed, half random) rather than
    full jitter (1.0: anywhere in [0, d]). Full jitter spreads clients best when many compete
    for one server; here the waits that coincide are few (the chats whose sends failed in
    the same Telegram outage, the groups whose runs failed when the model server went down),
    and a wait near zero wastes a try against a service that is most likely still down,
    while tries are counted (5 by default) and the chat is told "I'll try again in N s".
    Equal jitter still pulls those retries apart and keeps at least half of each wait.

    `jitter=0` gives the nominal delays (tests, a wait nobody else shares); `rng` (a
    `random.Random`) makes jittered delays reproducible.
    """

    base: float = 1.0
    factor: float = 2.0
    cap: float = 60.0
    jitter: float = EQUAL_JITTER
    rng: random.Random | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Written so that NaN fails every check.
        if not (self.base >= 0 and self.factor >= 1 and self.cap >= 0
                and 0 <= self.jitter <= 1):
            raise ValueError("a backoff needs base >= 0, factor >= 1, cap >= 0 and "
                             f"0 <= jitter <= 1 (got base={self.base}, factor={self.factor}, "
                             f"cap={self.cap}, jitter={self.jitter})")

    def nominal(self, attempt: int) -> float:
        """The delay after `attempt` failed tries before jitter: base for the first (and for
        0 or less), times factor for each one more, at most cap."""
        if self.base == 0:
            return 0.0
        try:
            d = self.base * float(self.factor) ** max(0, attempt - 1)
        except OverflowError:  # many tries: long past the cap
            return float(self.cap)
        return float(min(self.cap, d))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after `attempt` failed tries: the nominal delay, jittered."""
        d = self.nominal(attempt)
        if not self.jitter or not d:
            return d
        r = (self.rng or random).random()  # in [0, 1)
        return d * (1.0 - self.jitter * r)


async def wait(seconds: float, stop: asyncio.Event | None = None) -> bool:
    """Sleep `seconds`, or less if `stop` is set meanwhile (or already).

    Returns True when `stop` ended the wait, False when the time ran out.
    """
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return stop.is_set()
    return True


__all__ = ["EQUAL_JITTER", "FULL_JITTER", "NO_JITTER", "Backoff", "wait"]
