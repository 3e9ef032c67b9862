"""The container engine's own floor: `run --rm <image> true` through the Docker API (the
docker SDK, as the runtime uses it), with nothing of mdclaw in the way. A cold chat reply
cannot start sooner than this; docs/performance.md compares mdclaw's figures with it.

    DOCKER_HOST=unix:///run/podman/podman.sock CONTAINERS_CONF=/run/mdclaw-ci/containers.conf \\
        python bench/engine_floor.py [--runs 20] [--image mdclaw-test-base]

Figures: `engine_run_rm_true_ms` (create + start + wait + remove, what `docker run --rm`
does) and `engine_create_start_ms` (until the engine has started the process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import docker


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * p))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--image", default="mdclaw-test-base")
    args = ap.parse_args()
    client = docker.from_env()
    total, started = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        c = client.containers.create(args.image, ["true"], network_disabled=True)
        c.start()
        t1 = time.perf_counter()
        c.wait()
        c.remove(force=True)
        t2 = time.perf_counter()
        started.append((t1 - t0) * 1000)
        total.append((t2 - t0) * 1000)
    for name, xs in (("engine_run_rm_true_ms", total), ("engine_create_start_ms", started)):
        print(json.dumps({"figure": name, "n": len(xs), "p50_ms": round(statistics.median(xs), 1),
                          "p95_ms": round(pct(xs, 0.95), 1), "min_ms": round(min(xs), 1)}),
              flush=True)


if __name__ == "__main__":
    main()
