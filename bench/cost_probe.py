"""Where a command's CPU goes on the IPC loop's thread: thread-time probes around named pieces.

Loaded into a bench's mdclaw child through MDCLAW_BENCH_PRELOAD (`ipc_steady.py
--breakdown`), before mdclaw is imported. Each piece in PIECES is wrapped: while the probes
are on (SIGUSR1 turns them on from the next turn of the event loop, SIGUSR2 off), a call on
the main thread adds its `time.thread_time_ns()` to the path of pieces it runs under
("turn/round/apply/commit"), so a piece called from two places (BEGIN, say) is counted
under each. At exit the totals, and the main thread's CPU while the probes were on (from
/proc, in ns), go as JSON to MDCLAW_BENCH_PROBE_OUT. A piece missing from the tree measured
(an older checkout) is left out. A coroutine piece includes whatever ran while it waited:
the recording channel's send never waits, so on the benches' channels it is the piece's
own work.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import inspect
import json
import os
import signal
import threading
import time
from typing import Any

# (name, module the piece is looked up in, attribute path): the module where the caller
# finds it, so a function imported by name is wrapped where it is called from.
PIECES = [
    ("turn", "asyncio.base_events", "BaseEventLoop._run_once"),
    ("inotify", "mdclaw.ipc.watcher", "IpcWatcher._read_inotify"),
    ("round", "mdclaw.ipc.watcher", "IpcWatcher._work_once"),
    ("collect", "mdclaw.ipc.apply", "IpcEngine.collect"),
    ("apply", "mdclaw.ipc.apply", "IpcEngine.process"),
    ("read_file", "mdclaw.ipc.apply", "read_command_file"),
    ("json", "mdclaw.ipc.apply", "decode_json"),
    ("validate", "mdclaw.ipc.protocol", "parse_command"),
    ("begin", "mdclaw.state.db", "Database.begin"),
    ("ledger_lookup", "mdclaw.ipc.apply", "IpcEngine._ledger_hits"),
    ("command", "mdclaw.ipc.apply", "IpcEngine._apply"),
    ("open_rows", "mdclaw.ipc.apply", "has_open_rows"),
    ("outbox_insert", "mdclaw.ipc.apply", "enqueue"),
    ("page_write", "mdclaw.outbox", "OutboxWorker.write_locally"),
    ("commit", "mdclaw.state.db", "Database.end"),
    ("hand_off", "mdclaw.outbox", "OutboxWorker.hand_off"),
    ("written_locally", "mdclaw.outbox", "OutboxWorker.written_locally"),
    ("metrics", "mdclaw.ipc.apply", "metrics.observe_many"),
    ("removal_queued", "mdclaw.ipc.apply", "IpcEngine._remove_if_same"),
    ("removal", "mdclaw.ipc.apply", "BackgroundRemover._remove"),
    ("drain", "mdclaw.outbox", "OutboxWorker._drain_then_look"),
    ("deliver", "mdclaw.outbox", "OutboxWorker._deliver"),
    ("page_batch", "mdclaw.outbox", "OutboxWorker._deliver_locally"),
    ("flush", "mdclaw.outbox", "OutboxWorker._flush"),
]

_OUTER = PIECES[0][0]  # counting starts at a turn of the loop: paths begin with it
_on = False
_stack: list[str] = []
_acc: dict[str, list[int]] = {}
_main = threading.main_thread()
_span = [0, 0]  # the main thread's CPU (ns) when the probes went on; while they were on


def _main_cpu_ns() -> int:
    with open(f"/proc/self/task/{_main.native_id}/schedstat") as f:
        return int(f.read().split()[0])


def _counting(name: str) -> bool:
    """Whether this call of piece `name` is counted: probes on, the main thread, and under
    a turn of the loop (or the turn itself)."""
    return (_on and threading.current_thread() is _main
            and (bool(_stack) or name == _OUTER))


def _account(t0: int) -> None:
    path = "/".join(_stack)
    _stack.pop()
    a = _acc.get(path)
    if a is None:
        a = _acc[path] = [0, 0]
    a[0] += time.thread_time_ns() - t0
    a[1] += 1


def _wrap(name: str, fn: Any) -> Any:
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def awrapped(*args: Any, **kwargs: Any) -> Any:
            if not _counting(name):
                return await fn(*args, **kwargs)
            _stack.append(name)
            t0 = time.thread_time_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                _account(t0)
        return awrapped

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _counting(name):
            return fn(*args, **kwargs)
        _stack.append(name)
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _account(t0)
    return wrapped


def install() -> list[str]:
    """Wrap every piece found; returns the names of those missing."""
    missing = []
    for name, module, attr in PIECES:
        try:
            owner: Any = importlib.import_module(module)
            *path, last = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            raw = inspect.getattr_static(owner, last)
        except (ImportError, AttributeError):
            missing.append(name)
            continue
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw
        w = _wrap(name, fn)
        setattr(owner, last, staticmethod(w) if isinstance(raw, staticmethod) else w)
    return missing


def _switch(on: bool) -> None:
    global _on
    if on and not _on:  # (calls under way when they went off still pop what they pushed)
        _span[0] = _main_cpu_ns()
    elif not on and _on:
        _span[1] += _main_cpu_ns() - _span[0]
    _on = on


def _dump(missing: list[str]) -> None:
    _switch(False)
    out = os.environ.get("MDCLAW_BENCH_PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump({"main_cpu_ns": _span[1], "missing": missing,
                       "pieces": {k: {"ns": v[0], "calls": v[1]} for k, v in _acc.items()}}, f)


_missing = install()
signal.signal(signal.SIGUSR1, lambda *_: _switch(True))
signal.signal(signal.SIGUSR2, lambda *_: _switch(False))
atexit.register(_dump, _missing)
