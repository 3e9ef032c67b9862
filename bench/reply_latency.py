"""Chat message -> the model's first request, through the real daemon parts and a real engine,
stage by stage.

    DOCKER_HOST=unix:///run/podman/podman.sock CONTAINERS_CONF=/run/mdclaw-ci/containers.conf \\
        python bench/reply_latency.py [--rounds 5] [--image mdclaw-agent:e2e] [--no-spare]

The real Orchestrator, GroupQueue, CredentialProxy, ContainerRunner and DockerRuntime, the
real agent image (built as tests/e2e builds it: `mdclaw-agent:e2e`), and a scripted OpenAI
model server on loopback (tests/fake_models.py) reached only through the proxy's socket.
Each round: a message arrives for a group with no running container (**cold**), the model
answers; then a second message arrives while the conversation is still open (**warm**: a
follow-up into the running container); then the conversation is closed and the container
exits. Between rounds the runner may keep a created container ready (`--no-spare` turns
that off, to compare).

Cold stages, in milliseconds from the call of `on_inbound` (one JSON line per round):

  stored          the message is in the database
  picked          the group queue runs the job
  proxy_ready     the credential proxy's socket for the group is served
  create_call     the runner asks the engine to create the container (or, with a
                  created container kept ready, to start that one)
  created         the engine has created it (= create_call when a kept one is used)
  started         the engine has attached and started it
  process_up      the engine's own StartedAt of the container's process
  first_request   the model server receives the agent's first request

Warm: `warm_first_request` is the time from `on_inbound` of the follow-up to the model's
request carrying it. The summary line gives round 0 (the first message after start-up) on
its own and min / median of each over the later rounds, and the
engine's floor measured in the same run (`create + start` of `true`, and `run --rm true`,
as bench/engine_floor.py does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from fake_models import FakeOpenAI, say  # noqa: E402
from mdclaw import orchestrator as orch_mod  # noqa: E402
from mdclaw.channels.base import InboundMessage  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.integrations import load_all  # noqa: E402
from mdclaw.orchestrator import Orchestrator  # noqa: E402
from mdclaw.paths import Layout  # noqa: E402
from mdclaw.proxy import CredentialProxy  # noqa: E402
from mdclaw.reconcile import reconcile  # noqa: E402
from mdclaw.runner import ContainerRunner  # noqa: E402
from mdclaw.runtime import create_runtime  # noqa: E402
from mdclaw.state import Database  # noqa: E402

# perf_counter and the engine's wall clock: StartedAt is converted with this offset.
WALL_MINUS_PERF = time.time() - time.perf_counter()


def parse_started_at(text: str) -> float:
    """The engine's RFC 3339 StartedAt (nanoseconds, any offset) as a perf_counter value."""
    text = text.strip()
    head, _, rest = text.partition(".")
    frac, tz = "", ""
    for i, ch in enumerate(rest):
        if not ch.isdigit():
            frac, tz = rest[:i], rest[i:]
            break
    else:
        frac = rest
    if tz in ("Z", ""):
        tz = "+00:00"
    dt = datetime.fromisoformat(f"{head}{tz}")
    return dt.timestamp() + float(f"0.{frac or '0'}") - WALL_MINUS_PERF


class Marks:
    """Stage times of the current round (perf_counter), filled by thin wrappers."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.t.setdefault(name, time.perf_counter())


def instrument(marks: Marks, orch: Orchestrator, proxy: CredentialProxy,
               runtime: object) -> None:
    real_store = orch_mod.store_message

    def store(*a: object, **k: object) -> object:
        r = real_store(*a, **k)  # type: ignore[arg-type]
        marks.mark("stored")
        return r

    orch_mod.store_message = store  # type: ignore[assignment]

    real_run_job = orch.run_job

    async def run_job(job: object) -> object:
        marks.mark("picked")
        return await real_run_job(job)  # type: ignore[arg-type]

    orch.run_job = run_job  # type: ignore[method-assign]
    orch.queue.run_job = run_job  # type: ignore[attr-defined]

    real_start_for_config = proxy.start_for_config

    async def start_for_config(cfg: object, folder: str) -> object:
        r = await real_start_for_config(cfg, folder)  # type: ignore[arg-type]
        marks.mark("proxy_ready")
        return r

    proxy.start_for_config = start_for_config  # type: ignore[method-assign]

    rt = runtime
    real_create, real_start_created = rt.create, rt.start_created  # type: ignore[attr-defined]

    def create(spec: object) -> str:
        marks.mark("create_call")
        r = real_create(spec)
        marks.mark("created")
        return r

    def start_created(cid: str, spec: object) -> object:
        marks.mark("create_call")
        marks.mark("created")
        r = real_start_created(cid, spec)
        marks.mark("started")
        return r

    rt.create = create  # type: ignore[attr-defined]
    rt.start_created = start_created  # type: ignore[attr-defined]


def engine_floor(rt: object, image: str, runs: int) -> dict[str, float]:
    api = rt._api()  # type: ignore[attr-defined]
    cs, rm = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        c = api.create_container(image, ["true"], network_disabled=True)
        api.start(c["Id"])
        t1 = time.perf_counter()
        api.wait(c["Id"])
        api.remove_container(c["Id"], force=True)
        t2 = time.perf_counter()
        cs.append((t1 - t0) * 1000)
        rm.append((t2 - t0) * 1000)
    return {"engine_create_start_ms_min": round(min(cs), 1),
            "engine_create_start_ms_p50": round(statistics.median(cs), 1),
            "engine_run_rm_true_ms_min": round(min(rm), 1),
            "engine_run_rm_true_ms_p50": round(statistics.median(rm), 1)}


async def wait_until(cond, timeout: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


async def bench(args: argparse.Namespace) -> None:
    server = FakeOpenAI(fallback=lambda body: say("ok")).start()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        key = tmp / "model.key"
        key.write_text("sk-bench\n")
        key.chmod(0o600)
        cfgp = tmp / "config.yaml"
        cfgp.write_text(
            f"data_dir: {tmp / 'data'}\n"
            "assistant: {name: Andy, timezone: UTC, model: local}\n"
            "models:\n"
            f"  local: {{backend: openai, model: fake-model, base_url: '{server.url}/v1',"
            f" api_key_file: {key}}}\n"
            "groups:\n"
            "  main: {name: Admin, jid: 'hl:1', main: true, requires_trigger: false}\n"
            "  fam: {name: Fam, jid: 'hl:2', requires_trigger: false}\n"
            "limits: {container_timeout: 120s, idle_timeout: 60s, memory: 256m, pids: 128}\n"
            f"runtime: {{image: '{args.image}', install_id: bench-reply"
            f"{', keep_created: false' if args.no_spare else ''}}}\n")
        cfg = load_config(cfgp)
        load_all()  # as the daemon does at start-up
        rt = create_runtime(cfg.runtime)
        rt.ping()
        floor = engine_floor(rt, args.image, args.floor_runs)
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        proxy = CredentialProxy(Layout(cfg.data_dir), db)
        runner = ContainerRunner(cfg, rt)
        orch = Orchestrator(cfg, db, runner=runner, proxy=proxy)
        orch.engine_ready.set()
        marks = Marks()
        instrument(marks, orch, proxy, rt)
        rows: list[dict[str, float]] = []
        seq = 0
        try:
            for r in range(args.rounds):
                marks.t.clear()
                seq += 1
                n0 = len(server.requests)
                marks.t["inbound"] = t0 = time.perf_counter()
                await orch.on_inbound(InboundMessage(
                    id=f"m{seq}", chat_jid="hl:2", sender="u", sender_name="U",
                    content=f"hello {seq}", timestamp=f"2026-01-01T00:{seq // 60:02d}:"
                    f"{seq % 60:02d}.000Z"))
                await wait_until(lambda n=n0: len(server.requests) > n, 60, "first request")
                marks.t["first_request"] = server.requests[n0].at
                handle = runner.active("fam")
                assert handle is not None and handle.container_id
                info = await asyncio.to_thread(rt.inspect, handle.container_id)
                marks.t["process_up"] = parse_started_at(info["State"]["StartedAt"])
                row = {k: round((v - t0) * 1000, 1) for k, v in marks.t.items()
                       if k != "inbound"}
                # Warm: a follow-up into the running conversation, once its answer is out.
                await asyncio.sleep(0.3)
                seq += 1
                n1 = len(server.requests)
                t1 = time.perf_counter()
                await orch.on_inbound(InboundMessage(
                    id=f"m{seq}", chat_jid="hl:2", sender="u", sender_name="U",
                    content=f"again {seq}", timestamp=f"2026-01-01T00:{seq // 60:02d}:"
                    f"{seq % 60:02d}.000Z"))
                await wait_until(lambda n=n1: len(server.requests) > n, 30, "warm request")
                row["warm_first_request"] = round((server.requests[n1].at - t1) * 1000, 1)
                row["loadavg"] = round(__import__("os").getloadavg()[0], 2)
                print(json.dumps({"round": r, **row}), flush=True)
                rows.append(row)
                orch.close_conversations()
                orch.stopping.clear()
                await wait_until(lambda: runner.active("fam") is None, 60, "the run to end")
                await asyncio.sleep(args.pause)
        finally:
            orch.close_conversations()
            await wait_until(lambda: not runner.running(), 60, "runs to end")
            await runner.aclose()
            await proxy.close()
            rt.cleanup({"mdclaw.install": "bench-reply"})
            db.close()
            server.stop()
    keys = [k for k in rows[0] if k != "loadavg"]
    summary: dict[str, object] = {"figure": "reply_latency_ms", "rounds": len(rows),
                                  "spare": not args.no_spare, **floor}
    # Round 0 is the first message after start-up: nothing can have been created ahead.
    summary["first_round"] = {k: rows[0][k] for k in keys}
    later = rows[1:] or rows
    for k in keys:
        vals = [row[k] for row in later if k in row]
        summary[k] = [min(vals), round(statistics.median(vals), 1)]
    summary["loadavg"] = [row["loadavg"] for row in rows]
    print(json.dumps(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--image", default="mdclaw-agent:e2e")
    ap.add_argument("--no-spare", action="store_true")
    ap.add_argument("--floor-runs", type=int, default=5)
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds between rounds (a kept container is created meanwhile)")
    args = ap.parse_args()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
