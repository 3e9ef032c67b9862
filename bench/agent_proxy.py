"""Credential proxy overhead on time-to-first-byte of a streamed model response.

A fake Messages API on loopback streams a short answer (server-sent events). Each request
measures the time from sending it to the first body byte:

- `direct`: client → fake API over TCP;
- `proxy`: client → the group's unix socket → CredentialProxy (strip auth, inject the key
  from its file, read the body strictly, check the answer for the key, count usage) → fake
  API;
- `proxy_budget`: the same for a group with a daily token budget: each request also
  reserves its share of the budget at dispatch and gives it back at its end;
- `proxy_forwarder`: as the agent does it: client → loopback TCP port → the runner's
  in-container forwarder → unix socket → proxy → fake API.

Reported per path: p50/p95 over N requests (after a warm-up), and the p50 overhead against
`direct`. Target (issue 6): ≤ 2 ms added. Then, measured in this process alone (the
end-to-end figures move by more than these on a shared machine), what the request path's
checks cost: `admit_release_us` (Budget.admit and Reservation.release, with the usage in
memory), `read_strict_us` / `read_plain_us` (a 100 KB request body read with the repeated-
key and model-spelling checks, and with plain json.loads), `redact_us_per_100kb` (an
answer streamed through the key's Redactor in 1 KB chunks). Run: python bench/agent_proxy.py [N]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests"), str(REPO / "container" / "agent-runner"), str(REPO)]

from agent_helpers import ProxyThread  # noqa: E402
from fake_models import FakeAnthropic, say  # noqa: E402
from mdclaw.budget import Budget, Need  # noqa: E402
from mdclaw.models import Upstream, read_request  # noqa: E402
from mdclaw.paths import Layout  # noqa: E402
from mdclaw.redact import Redactor, all_forms  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw_agent.forwarder import Forwarder  # noqa: E402

BODY = {"model": "claude-x", "stream": True, "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]}


async def ttfb(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json=BODY, headers={"x-api-key": "placeholder"}) as r:
        await r.content.readany()
        first = time.perf_counter()
        await r.read()
    return (first - t0) * 1000


async def series(session: aiohttp.ClientSession, url: str, n: int) -> list[float]:
    for _ in range(20):
        await ttfb(session, url)
    return [await ttfb(session, url) for _ in range(n)]


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp))
        layout.group_ipc_dir("bench").mkdir(parents=True)
        key = Path(tmp) / "key"
        key.write_text("sk-bench")
        key.chmod(0o600)
        db = Database(layout.db_path)
        api = FakeAnthropic(script=[say("hello there")] * (5 * n + 200)).start()
        # The proxy on its own event loop thread, as in the daemon (the client, the fake API
        # and the forwarder each have theirs).
        proxy = ProxyThread(layout, db)
        # A request rate far above the default cap of 300 a minute, which the series would
        # exceed (they would then measure the proxy's 429 answers).
        sock = proxy.call(proxy.proxy.start_group(
            "bench", Upstream("claude", "claude-x", api.url, key), requests_per_minute=10**6))
        layout.group_ipc_dir("budget").mkdir(parents=True)
        budget_sock = proxy.call(proxy.proxy.start_group(
            "budget", Upstream("claude", "claude-x", api.url, key), tokens_per_day=10**12,
            requests_per_minute=10**6))
        fwd = Forwarder(sock).start()
        results = {}
        async with aiohttp.ClientSession() as direct:
            results["direct"] = await series(direct, f"{api.url}/v1/messages", n)
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as s:
            results["proxy"] = await series(s, "http://proxy/v1/messages", n)
        async with aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=str(budget_sock))) as s:
            results["proxy_budget"] = await series(s, "http://proxy/v1/messages", n)
        async with aiohttp.ClientSession() as s:
            results["proxy_forwarder"] = await series(s, f"{fwd.base_url}/v1/messages", n)
        fwd.stop()
        proxy.close()
        api.stop()
        db.close()
    base = statistics.median(results["direct"])
    for name, samples in results.items():
        s = sorted(samples)
        p50 = statistics.median(s)
        print(json.dumps({"figure": f"ttfb_{name}_ms", "n": len(s), "p50": round(p50, 3),
                          "p95": round(s[int(len(s) * 0.95) - 1], 3),
                          "overhead_p50_ms": round(p50 - base, 3), "target_overhead_ms": 2}))


def per_call_us(fn, rounds: int) -> float:  # noqa: ANN001
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter() - t0) / rounds * 1e6)
    return best


async def path_costs() -> None:
    class Used:
        async def tokens_today(self, folder: str) -> int:
            return 12_345

    budget = Budget(Used())

    async def admit_release() -> None:
        got = await budget.admit("g", 10**9, Need(100_000, 32_000))
        got.release()  # type: ignore[union-attr]

    rounds = 20_000
    t0 = time.perf_counter()
    for _ in range(rounds):
        await admit_release()
    admit_us = (time.perf_counter() - t0) / rounds * 1e6
    body = json.dumps({"model": "claude-x", "max_tokens": 32000, "stream": True, "messages": [
        {"role": "user" if i % 2 else "assistant",
         "content": [{"type": "text", "text": f"turn {i}: " + "lorem ipsum dolor " * 20}]}
        for i in range(270)]}).encode()
    answer = b"".join(b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                      b'"index":0,"delta":{"type":"text_delta","text":"word %d "}}\n\n' % i
                      for i in range(1000))[:100_000]
    forms = all_forms(["sk-ant-api03-" + "x" * 95 + "AA"])

    def redact() -> None:
        red = Redactor(forms)
        for i in range(0, len(answer), 1024):
            red.feed(answer[i:i + 1024])
        red.finish()

    figures = {"admit_release_us": admit_us,
               "read_strict_us": per_call_us(lambda: read_request(body), 50),
               "read_plain_us": per_call_us(lambda: json.loads(body), 50),
               "redact_us_per_100kb": per_call_us(redact, 50)}
    print(json.dumps({"figure": "request_path_costs", "body_bytes": len(body),
                      **{k: round(v, 2) for k, v in figures.items()}}))


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 300))
    asyncio.run(path_costs())
