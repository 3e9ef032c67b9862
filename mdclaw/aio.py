"""Waiting for tasks a component started in the background and did not await.

Such a component keeps its tasks in a set (or a dict) that each task's done callback takes it
out of, and waits for them at its stop. `wait_all` is that wait. It must not be written as
`while tasks: await asyncio.gather(*tasks)`: a task can be done while its done callback,
queued for the loop's next turn, has not taken it out yet. Since Python 3.12, `gather` of tasks
that are all done is done at once, without a turn of the loop, so that loop would gather the
same done task again and again and never let the callback run: the stop spins forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any


async def wait_all(tasks: Collection[asyncio.Future[Any]]) -> None:
    """Wait until `tasks` is empty: every task in it done and taken out by its done callback,
    tasks added meanwhile too. A task's exception is taken (not raised): each task reports its
    own failure. A collection its tasks never leave (no done callback) is waited for forever,
    a turn of the loop at a time."""
    while tasks:
        pending = []
        for t in tasks:
            if not t.done():
                pending.append(t)
            elif not t.cancelled():
                t.exception()  # taken, as gather(return_exceptions=True) takes them
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        else:
            await asyncio.sleep(0)  # their done callbacks come in this turn


__all__ = ["wait_all"]
