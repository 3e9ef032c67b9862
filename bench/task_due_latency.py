"""Due → the task's container started, while the group's conversation container idles.

A real `mdclaw run`, the real agent image on the real engine and a scripted model server
(tests/e2e/task_due.py): each round opens a conversation and leaves it idle (idle_timeout
10 minutes), adds a one-shot task due 2 s later, and reads the task container's
State.StartedAt from the engine. Before the fix the task waited for the idle timer.

Target: < 2 s. Run (engine as in tests/e2e): python bench/task_due_latency.py [ROUNDS]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "tests"), str(REPO)]

from e2e_images import build_agent_image  # noqa: E402
from task_due import run_rounds  # noqa: E402

from mdclaw.runtime import find_socket  # noqa: E402
from mdclaw.runtime.docker_engine import DockerRuntime  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    url = find_socket()
    engine = DockerRuntime(url, engine="podman" if "podman" in url else "docker")
    image = build_agent_image(engine, REPO, "mdclaw-agent:e2e")
    install = f"bench-{uuid.uuid4().hex[:10]}"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            got = run_rounds(engine, image, Path(tmp), install, rounds)
        finally:
            engine.cleanup({"mdclaw": "true", "mdclaw.install": install})
    s = sorted(r.late_s * 1000 for r in got)
    print(json.dumps({"figure": "task_due_to_container_started_conversation_idle_ms",
                      "n": len(s), "p50": round(statistics.median(s), 1),
                      "p95": round(s[max(0, int(len(s) * 0.95) - 1)], 1),
                      "max": round(s[-1], 1), "target_ms": 2000, "engine": engine.engine}))


if __name__ == "__main__":
    main()
