"""Properties of the agent's input watcher and the proxy's usage counting, over generated
inputs: follow-ups arriving in any pattern are each seen exactly once and in order, with
inotify and with polling only; token counts do not depend on how a stream is chunked."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_helpers import write_input
from mdclaw.usage import UsageCounter
from mdclaw_agent.ipc import InputWatcher

# Each follow-up: pause before it (0 = same burst) and whether _close follows it at once.
arrivals = st.lists(st.tuples(st.sampled_from([0, 0, 0, 0.001, 0.01, 0.03]), st.booleans()),
                    min_size=1, max_size=25)


def _run(tmp: Path, plan: list[tuple[float, bool]], use_inotify: bool) -> None:
    inbox = tmp / "input"
    watcher = InputWatcher(inbox, poll_seconds=0.02, use_inotify=use_inotify)
    assert watcher.uses_inotify == use_inotify
    written: list[str] = []
    close_after = next((i for i, (_, close) in enumerate(plan) if close), len(plan) - 1)

    def writer() -> None:
        for i, (pause, _) in enumerate(plan[:close_after + 1]):
            if pause:
                time.sleep(pause)
            name = f"{1700000000000 + i}-{i:04d}.json"
            write_input(inbox, {"text": f"m{i}"}, name)
            written.append(f"m{i}")
        write_input(inbox, None, "_close")

    t = threading.Thread(target=writer)
    t.start()
    seen = []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            item = watcher.next(timeout=1)
            if item is None and watcher.closed:
                break
            if item is not None:
                seen.append(item.text)
    finally:
        t.join()
        watcher.close()
    assert seen == written  # every one, once, in order — also those that came with _close
    assert list(inbox.iterdir()) == []


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=arrivals)
def test_follow_ups_exactly_once_with_inotify(tmp_path_factory, plan) -> None:
    _run(tmp_path_factory.mktemp("ino"), plan, use_inotify=True)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=arrivals)
def test_follow_ups_exactly_once_polling_only(tmp_path_factory, plan) -> None:
    _run(tmp_path_factory.mktemp("poll"), plan, use_inotify=False)


def _anthropic_stream(inp: int, out: int) -> bytes:
    events = [
        ("message_start", {"type": "message_start", "message": {
            "usage": {"input_tokens": inp, "output_tokens": 1}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "text_delta", "text": "usage: é 😀"}}),
        ("message_delta", {"type": "message_delta", "usage": {"output_tokens": out}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return "".join(f"event: {k}\ndata: {json.dumps(v, ensure_ascii=False)}\n\n"
                   for k, v in events).encode()


@settings(max_examples=200, deadline=None)
@given(inp=st.integers(0, 10**7), out=st.integers(1, 10**6),
       cuts=st.lists(st.integers(0, 2000), max_size=30))
def test_usage_counts_do_not_depend_on_chunking(inp, out, cuts) -> None:
    data = _anthropic_stream(inp, out)
    points = sorted({c % (len(data) + 1) for c in cuts})
    counter = UsageCounter()
    prev = 0
    for p in points + [len(data)]:
        counter.feed_sse(data[prev:p])
        prev = p
    counter.finish()
    assert (counter.input_tokens, counter.output_tokens) == (inp, out)
