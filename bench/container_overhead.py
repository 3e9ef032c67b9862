"""mdclaw's own overhead per container run, apart from the engine's.

    python bench/container_overhead.py [--runs 30] [--concurrency 1]

Needs an engine (DOCKER_HOST or the usual sockets) with the test base image
`mdclaw-test-base` (see .ci/setup-engine); builds a small image with tests/e2e/fake_agent.py.
Each run goes through the real GroupQueue and ContainerRunner; the container prints one
output block (with its own clock reading) and exits. Figures (one JSON line each, in ms):

  host_pickup_to_start_call   queue picks the job -> runtime.start() is called (mdclaw:
                              spec, folders, settings file, mount checks, thread hop)
  host_exit_to_result_handled output stream ends (container exited) -> run_job has the
                              result in hand, less the engine's exit-status answer (mdclaw:
                              thread hops, result, parsing already done while streaming)
  exit_to_result_handled_total the same with the exit-status query included
  engine_start                runtime.start(): create + attach + start (the engine)
  engine_exit_report          the container's last write -> its stream ends (the engine)
  engine_exit_status          asking the engine for the exit status after the stream ended
  run_total                   pick-up -> result handled, whole run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mdclaw.config import Config  # noqa: E402
from mdclaw.queue import GroupQueue, Job  # noqa: E402
from mdclaw.runner import ContainerInput, ContainerRunner  # noqa: E402
from mdclaw.runtime import find_socket  # noqa: E402
from mdclaw.runtime.docker_engine import DockerRuntime  # noqa: E402

TAG = "mdclaw-bench-agent:latest"


def build_image(rt: DockerRuntime, base: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        ctx = Path(d)
        shutil.copy(REPO / "tests" / "e2e" / "fake_agent.py", ctx / "fake_agent.py")
        (ctx / "Dockerfile").write_text(
            f"FROM {base}\nCOPY fake_agent.py /opt/fake_agent.py\n"
            'ENTRYPOINT ["python3", "-u", "/opt/fake_agent.py"]\n')
        rt.build_image(TAG, ctx / "Dockerfile", ctx)


def stats(name: str, values: list[float], **extra: object) -> dict[str, object]:
    values = sorted(values)
    p95 = values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]
    return {"figure": name, "unit": "ms", "n": len(values),
            "p50": round(statistics.median(values), 2), "p95": round(p95, 2),
            "max": round(values[-1], 2), "mean": round(statistics.fmean(values), 2), **extra}


async def bench(rt: DockerRuntime, runs: int, concurrency: int, data_dir: Path) -> list[dict]:
    groups = {f"g{i}": {"name": f"G{i}", "jid": f"tg:{i}", "main": i == 0}
              for i in range(max(concurrency, 1))}
    cfg = Config(data_dir=data_dir, groups=groups,
                 limits={"max_concurrent_containers": concurrency, "memory": "256m",
                         "cpus": 1.0, "pids": 64},
                 runtime={"image": TAG, "install_id": "bench"})
    runner = ContainerRunner(cfg, rt)
    await runner.cleanup_orphans()
    rows: dict[str, list[float]] = {k: [] for k in (
        "host_pickup_to_start_call", "host_exit_to_result_handled",
        "exit_to_result_handled_total", "engine_start", "engine_exit_report",
        "engine_exit_status", "run_total")}

    async def run_job(job: Job) -> None:
        res = await runner.run(job.group, ContainerInput("bench", job.group, "tg:0"),
                               command=["blocks", "1", "0"])
        handled = time.perf_counter()
        if res.status != "success":
            raise RuntimeError(f"run failed: {res.error} {res.stderr_tail}")
        m = res.marks
        rows["host_pickup_to_start_call"].append((m["start_call"] - job.picked_at) * 1000)
        status_ms = (m["waited"] - m["wait_call"]) * 1000
        rows["exit_to_result_handled_total"].append((handled - m["eof"]) * 1000)
        rows["engine_exit_status"].append(status_ms)
        rows["host_exit_to_result_handled"].append((handled - m["eof"]) * 1000 - status_ms)
        rows["engine_start"].append((m["started"] - m["start_call"]) * 1000)
        last_write = json.loads(res.output)["t"]  # the container's wall clock, same host
        eof_wall = time.time() - (time.perf_counter() - m["eof"])
        rows["engine_exit_report"].append((eof_wall - last_write) * 1000)
        rows["run_total"].append((handled - job.picked_at) * 1000)

    q = GroupQueue(run_job, max_concurrent=concurrency, retry_base=0.1, max_attempts=1)
    # one warm-up run, not counted
    q.enqueue_message("g0")
    await q.join()
    for v in rows.values():
        v.clear()
    for i in range(runs):
        q.enqueue_message(f"g{i % len(groups)}")
    t0 = time.perf_counter()
    await q.join()
    wall = time.perf_counter() - t0
    await runner.aclose()
    if q.failures:
        raise SystemExit(f"{len(q.failures)} run(s) failed: {q.failures[0].error}")
    extra = {"concurrency": concurrency, "engine": rt.ping().split(" at ")[0]}
    out = [stats(k, v, **extra) for k, v in rows.items()]
    out.append({"figure": "runs_per_second", "value": round(runs / wall, 2), "n": runs, **extra})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--base-image", default="mdclaw-test-base")
    args = ap.parse_args()
    rt = DockerRuntime(find_socket())
    rt.ping()
    if rt.image_info(TAG) is None:
        build_image(rt, args.base_image)
    with tempfile.TemporaryDirectory(prefix="mdclaw-bench-") as d:
        for row in asyncio.run(bench(rt, args.runs, args.concurrency, Path(d) / "data")):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
