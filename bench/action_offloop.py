"""IPC commit latency of other groups while slow off-loop actions are in flight.

The real IPC loop (with its action worker) runs in a child process. A local aiohttp server
answers every request after `--delay` seconds (5 s). Phase "idle": pause/resume commands of
groups g011.. are timed from rename to COMMIT, nothing else running. Phase "loaded": 10
web_fetch requests (2 from each of g001..g005, `limits.action_jobs: 10`) to the slow server
are made; once the server holds all 10, the same commands are timed, for as long as all 10
are still in flight (then 10 new fetches start). Target: loaded p99 within 2x of idle p99.

    python bench/action_offloop.py [--samples 300] [--groups 30] [--delay 5] [--root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web

from ipc_common import PauseResume, emit, make_data_dir, one_task_per_group, p50_p99, serve, stage

FETCHERS = [f"g{i:03d}" for i in range(1, 6)]


class SlowServer:
    """Answers every GET after `delay` seconds; counts requests in flight."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = 0
        self.served = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def slow(request: web.Request) -> web.Response:
            self.in_flight += 1
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.in_flight -= 1
            self.served += 1
            return web.Response(text="<p>slow page</p>", content_type="text/html")

        app = web.Application()
        app.router.add_get("/slow", slow)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set()
        self.loop.run_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--groups", type=int, default=30)
    ap.add_argument("--delay", type=float, default=5.0)
    ap.add_argument("--gap", type=float, default=0.005, help="seconds between commands")
    ap.add_argument("--root", default=None, help="where the data dir goes (default: $TMPDIR)")
    args = ap.parse_args()
    rng = random.Random(1)
    slow = SlowServer(args.delay)
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        root = Path(tmp)
        cfg = make_data_dir(root, args.groups)
        text = cfg.read_text().replace(
            "limits: {errors_max_files: 100000}",
            "limits: {errors_max_files: 100000, action_jobs: 10}\n"
            "web: {enabled: true, allow_private: ['127.0.0.1/32']}")
        cfg.write_text(text)
        ipc = root / "data" / "ipc"
        groups = [f"g{i:03d}" for i in range(11, args.groups)]
        one_task_per_group(ipc, groups)
        server = serve(cfg)
        fetch_ids: list[tuple[str, str]] = []
        try:
            timed = PauseResume(ipc, groups, rng, args.gap)
            for _ in range(args.samples):
                timed.sample("idle")
            loaded = 0
            rounds = 0
            while loaded < args.samples:
                rounds += 1
                for g in FETCHERS:
                    for k in range(2):
                        rid = f"f{rounds}-{g}-{k}"
                        fetch_ids.append((g, rid))
                        d = ipc / g / "actions"
                        d.mkdir(exist_ok=True)
                        stage(d / f"{rid}.json", {
                            "type": "action", "requestId": rid, "action": "web_fetch",
                            "params": {"url": f"http://127.0.0.1:{slow.port}/slow"}}
                        ).rename(d / f"{rid}.json")
                deadline = time.monotonic() + 30
                while slow.in_flight < 10:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"only {slow.in_flight} fetches in flight")
                    time.sleep(0.005)
                while slow.in_flight == 10 and loaded < args.samples:
                    timed.sample("loaded")
                    loaded += 1
            deadline = time.monotonic() + args.delay + 30
            results = ipc.parent / "ipc"
            while not all((results / g / "action_results" / f"{r}.json").exists()
                          for g, r in fetch_ids):
                if time.monotonic() > deadline:
                    raise SystemExit("fetch results missing")
                time.sleep(0.05)
            ok = sum(json.loads((results / g / "action_results" / f"{r}.json").read_text())
                     ["status"] == "success" for g, r in fetch_ids)
        finally:
            commits = server.stop()
    by_phase = timed.commit_ms(commits)
    idle50, idle99 = p50_p99(by_phase["idle"])
    load50, load99 = p50_p99(by_phase["loaded"])
    common = {"samples": args.samples, "groups": args.groups, "fetches_in_flight": 10,
              "fetch_delay_s": args.delay, "fetches_ok": ok, "fetches": len(fetch_ids)}
    emit("action_offloop_commit_idle_p50", idle50, "ms", **common)
    emit("action_offloop_commit_idle_p99", idle99, "ms", **common)
    emit("action_offloop_commit_loaded_p50", load50, "ms", **common)
    emit("action_offloop_commit_loaded_p99", load99, "ms", **common)
    emit("action_offloop_p99_ratio", load99 / idle99, "x", target="<= 2", **common)


if __name__ == "__main__":
    main()
