"""Follow-up latency: from a follow-up file landing in input/ to the agent seeing it.

Two figures, each over N follow-ups written atomically (temp file + rename, as the host does):

- `followup_watcher_ms`: the runner's InputWatcher (inotify wake-up, 500 ms poll fallback)
  returning the follow-up;
- `followup_to_model_request_ms`: the real runner in a subprocess (openai backend) until the
  scripted model server on loopback receives the request carrying the follow-up — i.e. the
  agent acted on it.

Target (issue 6): ≤ 20 ms. Run: python bench/agent_followup.py [N]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "container" / "agent-runner"), str(REPO)]

from agent_helpers import RunnerProcess, write_input  # noqa: E402
from fake_models import FakeOpenAI  # noqa: E402
from mdclaw_agent.ipc import InputWatcher  # noqa: E402


def figure(name: str, samples_ms: list[float], **extra) -> None:
    s = sorted(samples_ms)
    print(json.dumps({"figure": name, "n": len(s), "p50": round(statistics.median(s), 3),
                      "p95": round(s[int(len(s) * 0.95) - 1], 3), "max": round(s[-1], 3),
                      "target_ms": 20, **extra}))


def bench_watcher(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        inbox = Path(tmp) / "input"
        w = InputWatcher(inbox, poll_seconds=0.5)
        inotify = w.uses_inotify
        samples = []
        for i in range(n):
            t0 = time.perf_counter()
            write_input(inbox, {"text": f"m{i}"}, f"{1700000000000 + i}-x.json")
            item = w.next(timeout=2)
            samples.append((time.perf_counter() - t0) * 1000)
            assert item is not None and item.text == f"m{i}"
        w.close()
        figure("followup_watcher_ms", samples, inotify=inotify)


def bench_runner(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, FakeOpenAI() as server:
        root = Path(tmp)
        for d in ("ipc/input", "group", "global"):
            (root / d).mkdir(parents=True)
        inp = {"prompt": "start", "groupFolder": "bench", "chatJid": "x", "backend": "openai",
               "model": "m"}
        r = RunnerProcess(inp, ipc_dir=root / "ipc", group_dir=root / "group",
                          global_dir=root / "global",
                          env={"MDCLAW_MODEL_BASE_URL": server.url})
        r.wait_results(1)
        samples = []
        for i in range(n):
            before = len(server.requests)
            t0 = time.monotonic()
            write_input(root / "ipc" / "input", {"text": f"f{i}"}, f"{1700000000000 + i}-x.json")
            reqs = server.wait_for(before + 1, timeout=10)
            samples.append((reqs[before].at - t0) * 1000)
            r.wait_results(i + 2)
        write_input(root / "ipc" / "input", None, "_close")
        r.wait_exit(10)
        figure("followup_to_model_request_ms", samples)


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    bench_watcher(count)
    bench_runner(min(count, 100))
