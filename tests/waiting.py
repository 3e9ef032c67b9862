"""Waiting for something to happen, with a deadline: the one way tests wait.

`wait_until(predicate, timeout, what=...)` polls `predicate()` until it returns something
true and returns that value; `await wait_until_async(...)` does the same without blocking the
event loop. When the deadline passes first, they raise an AssertionError that names what was
awaited and for how long, so a test that would have hung fails with a traceback instead.

`what` defaults to the predicate's source line (a lambda) or name. `predicate` may raise an
AssertionError of its own to fail at once (e.g. "the daemon exited"); exceptions listed in
`ignore` count as "not yet" and the last one is shown if the wait times out (a server that
does not accept connections yet).
"""

from __future__ import annotations

import asyncio
import inspect
import linecache
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

POLL = 0.01  # seconds between two looks


def describe(predicate: Callable[[], object]) -> str:
    """`predicate` for a person: a lambda's source line, else its name; with file:line."""
    code = getattr(predicate, "__code__", None)
    if code is None:
        return repr(predicate)
    where = f"{Path(code.co_filename).name}:{code.co_firstlineno}"
    line = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    if predicate.__name__ == "<lambda>" and "lambda" in line:
        body = line.split("lambda", 1)[1].split(":", 1)[-1].strip()
        return f"`{body[:120]}` ({where})"
    return f"{predicate.__qualname__}() ({where})"


def _timed_out(what: str | None, predicate: Callable[[], object], timeout: float,
               last: BaseException | None) -> AssertionError:
    msg = f"timed out after {timeout:g} s waiting for {what or describe(predicate)}"
    if last is not None:
        msg += f" (last error: {type(last).__name__}: {last})"
    return AssertionError(msg)


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, *,
               what: str | None = None, interval: float = POLL,
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Call `predicate` every `interval` s until it returns a true value; return it. Raise
    AssertionError naming `what` (by default the predicate's source) when `timeout` s pass
    first."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
        except ignore as e:
            last = e
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, predicate, timeout, last)
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], T | Awaitable[T]], timeout: float = 10.0,
                           *, what: str | None = None, interval: float = POLL,
                           ignore: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` for coroutines: the event loop runs between two looks. `predicate` may
    be a coroutine function (it is awaited each time)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignore as e:
            last = e
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            raise _timed_out(what, predicate, timeout, last)
        await asyncio.sleep(interval)


async def holds_for(predicate: Callable[[], object], seconds: float, *,
                    what: str | None = None, interval: float = POLL) -> None:
    """Check that `predicate` stays true for `seconds` (something must NOT happen in a
    window): raise AssertionError naming `what` as soon as it is false."""
    deadline = time.monotonic() + seconds
    while True:
        assert predicate(), f"no longer true: {what or describe(predicate)}"
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(interval)
