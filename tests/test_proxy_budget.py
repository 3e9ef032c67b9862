"""The daily token budget under concurrent bursts at the credential proxy: requests reserve
their share of what is left when they are sent upstream (not when they arrive), so a burst
cannot spend more than the budget plus one answer; every reservation is given back when its
answer ends — also when the agent hangs up, the upstream breaks off or the group's proxy is
stopped — with the real usage counted.

The agent is a client on the group's unix socket; the upstream a fake Messages API that
answers every request with a fixed usage and counts what it answered (what was "spent").
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent_helpers import ProxyThread
from fake_models import FakeAnthropic, FakeOpenAI, _Server
from mdclaw.models import Upstream
from mdclaw.paths import Layout
from mdclaw.state import Database
from mdclaw.usage import usage_rows

USAGE = (40, 20)  # every answer: 60 tokens
ANSWER = sum(USAGE)


class CountingAnthropic(FakeAnthropic):
    """A Messages API that also knows how many of its answers were under way at once."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        super().__init__(usage=USAGE, **kw)
        self.now = 0
        self.most = 0

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            return await super()._messages(request)
        finally:
            self.now -= 1


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    db = Database(layout.db_path)
    proxy = ProxyThread(layout, db)
    yield layout, db, proxy
    proxy.close()
    db.close()


def start(proxy: ProxyThread, url: str, budget: int, **kw) -> Path:  # noqa: ANN003
    return proxy.call(proxy.proxy.start_group(
        "family", Upstream("claude", "claude-x", url), tokens_per_day=budget,
        max_connections=1024, requests_per_minute=100_000, timezone="Europe/Berlin", **kw))


IN_FLIGHT = 100  # below the proxy socket's listen queue (agentfs: listen(128))


async def burst(sock: Path, n: int, body: dict) -> list[tuple[int, dict[str, str], bytes]]:
    """`n` requests at once, each on its own connection (none reused: a kept-alive one can be
    closed by the server just as the client sends on it, which the SDKs retry and this test
    would not), at most IN_FLIGHT connecting at a time: the proxy's socket queues 128
    connections it has not accepted yet, and a unix socket whose queue is full fails the
    connect (asyncio then hands back a socket that was never connected), which a loaded
    machine's accept loop lets happen to a thousand at once."""
    conn = aiohttp.UnixConnector(path=str(sock), limit=IN_FLIGHT, force_close=True)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one() -> tuple[int, dict[str, str], bytes]:
            async with s.post("http://proxy/v1/messages", json=body,
                              headers={"x-api-key": "placeholder"}) as r:
                return r.status, dict(r.headers), await r.read()
        return await asyncio.gather(*(one() for _ in range(n)))


def until(cond, what: str, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize(("n", "budget", "stream"), [
    (40, 100, False), (40, 100, True), (1000, 500, False)])
def test_a_burst_spends_at_most_the_budget_plus_one_answer(env, n, budget, stream) -> None:
    """The attack: many requests at once against a small budget. Before, every one that
    arrived before the first answer was counted went (40 × 60 = 2,400 of 100)."""
    layout, db, proxy = env
    body = {"model": "claude-x", "max_tokens": 20, "stream": stream,
            "messages": [{"role": "user", "content": "hi"}]}
    with CountingAnthropic(first_byte_delay=0.2) as up:
        sock = start(proxy, up.url, budget)
        replies = asyncio.run(burst(sock, n, body))
        answered = len(up.requests)
        most = up.most
        # The proxy has given every reservation back.
        assert proxy.proxy.budget.reserved("family") == (0, 0)
        caps = proxy.proxy.caps("family")
    spent = answered * ANSWER  # what the upstream handed out
    assert budget <= spent <= budget + ANSWER
    ok = [r for r in replies if r[0] == 200]
    refused = [r for r in replies if r[0] != 200]
    assert len(ok) == answered and len(ok) + len(refused) == n
    for status, headers, raw in refused:
        assert status == 429
        err = json.loads(raw)["error"]
        assert err["type"] == "mdclaw_over_budget"
        assert f"of {budget} tokens" in err["message"]
        assert "It resets at midnight UTC" in err["message"]
        assert "Europe/Berlin" in err["message"]
        assert 1 <= int(headers["Retry-After"]) <= 86400
        assert headers["x-should-retry"] == "false"
    assert caps is not None and caps["over_budget"] == len(refused)
    if budget >= 5 * (len(json.dumps(body)) + 20):
        # Several requests fit in the budget at once, and went side by side.
        assert most > 1
    # The usage ledger holds what the upstream counted, no more and no less.
    stats = proxy.proxy.ledger.stats["family"]
    assert stats["requests"] == answered
    assert stats["input_tokens"] + stats["output_tokens"] == spent
    proxy.flush()
    [row] = usage_rows(db, group="family")
    assert (row["requests"], row["input_tokens"] + row["output_tokens"]) == (answered, spent)


class ChoosingOpenAI(FakeOpenAI):
    """A Chat Completions API that answers `n` choices of 20 tokens each (40 in)."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        n = body.get("n", 1) if isinstance(body, dict) else 1
        await asyncio.sleep(0.2)
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": i, "message": {"role": "assistant", "content": "x"},
                         "finish_reason": "length"} for i in range(n)],
            "usage": {"prompt_tokens": 40, "completion_tokens": 20 * n}})


def test_a_burst_of_requests_for_many_answers_is_bounded_too(env) -> None:
    """OpenAI's `n`: 50 answers of at most 20 tokens each. Before, each request reserved
    one answer, so 8 went side by side: 8,320 tokens spent of 1,000."""
    layout, db, proxy = env
    body = {"model": "gpt-x", "max_tokens": 20, "n": 50,
            "messages": [{"role": "user", "content": "hi"}]}
    one = 40 + 20 * 50
    with ChoosingOpenAI() as up:
        sock = proxy.call(proxy.proxy.start_group(
            "family", Upstream("openai", "gpt-x", up.url + "/v1"), tokens_per_day=1000,
            max_connections=1024, requests_per_minute=100_000))

        async def go() -> list[int]:
            conn = aiohttp.UnixConnector(path=str(sock), limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s:
                async def post() -> int:
                    async with s.post("http://proxy/v1/chat/completions", json=body) as r:
                        await r.read()
                        return r.status
                return await asyncio.gather(*(post() for _ in range(10)))

        statuses = asyncio.run(go())
        answered = len(up.requests)
    assert statuses.count(200) == answered and statuses.count(429) == 10 - answered
    assert 1000 <= answered * one <= 1000 + one  # one request alone, and the day is spent


def test_requests_that_fit_go_side_by_side(env) -> None:
    """A budget with room for many answers does not make requests wait for each other."""
    layout, db, proxy = env
    with CountingAnthropic(first_byte_delay=0.3) as up:
        sock = start(proxy, up.url, 1_000_000)
        replies = asyncio.run(burst(sock, 16, {"model": "claude-x", "max_tokens": 100}))
        assert [r[0] for r in replies] == [200] * 16
        assert up.most == 8  # the concurrency cap, not the budget, set the pace
    assert proxy.proxy.budget.reserved("family") == (0, 0)


async def _hang_up_after_first_chunk(sock: Path, body: dict) -> bytes:
    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as s:
        r = await s.post("http://proxy/v1/messages", json=body)
        first = await r.content.readany()
        r.close()  # the connection is dropped with the answer half read
        return first


def test_an_agent_that_hangs_up_mid_answer_is_counted_what_the_answer_cost(env) -> None:
    layout, db, proxy = env
    with CountingAnthropic(event_delay=0.1) as up:
        sock = start(proxy, up.url, 10_000)
        first = asyncio.run(_hang_up_after_first_chunk(
            sock, {"model": "claude-x", "max_tokens": 3000, "stream": True}))
        assert b"message_start" in first
        # The proxy reads the answer on to its end (the stream had 7 events, 0.1 s apart).
        until(lambda: proxy.proxy.ledger.stats["family"]["requests"] == 1,
              "the cut answer to be counted")
        assert proxy.proxy.budget.reserved("family") == (0, 0)
    stats = proxy.proxy.ledger.stats["family"]
    # The API's own count (message_delta's), not the 3,000 reserved for the answer.
    assert (stats["input_tokens"], stats["output_tokens"]) == USAGE
    assert stats["errors"] == 0


class BreakingAnthropic(_Server):
    """A Messages API that starts a streamed answer (its input usage) and breaks off."""

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        await self._record(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {"type": "message_start", "message": {"usage": {"input_tokens": 40,
                                                                "output_tokens": 1}}}
        await resp.write(f"event: message_start\ndata: {json.dumps(start)}\n\n".encode())
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        raise asyncio.CancelledError


def test_an_answer_broken_off_counts_its_reservation_for_what_was_not_reported(env) -> None:
    layout, db, proxy = env
    with BreakingAnthropic() as up:
        sock = start(proxy, up.url, 10_000)
        replies = asyncio.run(burst(sock, 1, {"model": "claude-x", "max_tokens": 500,
                                              "stream": True}))
    assert replies[0][0] == 200  # the stream had begun; it ends short
    assert proxy.proxy.budget.reserved("family") == (0, 0)
    stats = proxy.proxy.ledger.stats["family"]
    # Input as the API reported it; the answer as reserved (the API may have billed it).
    assert (stats["input_tokens"], stats["output_tokens"]) == (40, 500)
    assert proxy.proxy.recent_failure("family") == "model_disconnected"


def test_stopping_the_group_gives_back_what_its_requests_held(env) -> None:
    import threading

    layout, db, proxy = env
    body = {"model": "claude-x", "max_tokens": 700, "messages": []}
    with CountingAnthropic(first_byte_delay=30) as up:
        sock = start(proxy, up.url, 10_000)
        t = threading.Thread(target=lambda: _quiet(asyncio.run, burst(sock, 3, body)),
                             daemon=True)
        t.start()
        up.wait_for(3, 10)
        assert proxy.proxy.budget.reserved("family")[0] == 3
        t0 = time.monotonic()
        proxy.call(proxy.proxy.stop_group("family"))
        assert time.monotonic() - t0 < 5
        assert proxy.proxy.budget.reserved("family") == (0, 0)
        stats = proxy.proxy.ledger.stats["family"]
    # Nothing reported: each counts as reserved (the body's bytes, and its max_tokens).
    sent = len(json.dumps(body, separators=(",", ":")))
    assert stats["requests"] == 3
    assert (stats["input_tokens"], stats["output_tokens"]) == (3 * sent, 3 * 700)


def test_errors_and_unreachable_upstreams_spend_nothing(env, tmp_path) -> None:
    layout, db, proxy = env
    sock = start(proxy, "http://127.0.0.1:9", 10_000)
    replies = asyncio.run(burst(sock, 3, {"model": "claude-x", "max_tokens": 700}))
    assert [r[0] for r in replies] == [502] * 3
    assert proxy.proxy.budget.reserved("family") == (0, 0)
    stats = proxy.proxy.ledger.stats["family"]
    assert (stats["requests"], stats["errors"], stats["input_tokens"],
            stats["output_tokens"]) == (3, 3, 0, 0)


def test_counting_tokens_and_listing_models_reserve_nothing(env) -> None:
    """Only requests that make the model answer hold a share of the budget: counting tokens
    beside a request in flight that holds all that is left is not held up."""
    layout, db, proxy = env
    with CountingAnthropic(first_byte_delay=1.0) as up:
        sock = start(proxy, up.url, 100)

        async def go() -> tuple[int, float]:
            conn = aiohttp.UnixConnector(path=str(sock), limit=0, force_close=True)
            async with aiohttp.ClientSession(connector=conn) as s:
                big = asyncio.ensure_future(s.post(
                    "http://p/v1/messages", json={"model": "claude-x", "max_tokens": 5000}))
                while not up.requests:
                    await asyncio.sleep(0.01)
                t0 = time.monotonic()
                async with s.post("http://p/v1/messages/count_tokens",
                                  json={"model": "claude-x", "messages": []}) as r:
                    status = r.status
                took = time.monotonic() - t0
                (await big).close()
                return status, took

        status, took = asyncio.run(go())
    assert status == 200 and took < 0.9


def _quiet(fn, *args) -> None:  # noqa: ANN001
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the connections are cut on purpose
        pass


def test_an_asked_agents_use_counts_against_the_askers_budget(env) -> None:
    """While `family`'s agent answers a question of `main`'s (ask_agent: charge_also), its
    tokens are counted for main too (a row `asked:family/<model>`), and once main's budget
    is used up, family's requests are refused too; when the question is answered, main's
    budget no longer applies to family."""
    layout, db, proxy = env
    with CountingAnthropic() as up:
        sock = start(proxy, up.url, 100_000)

        async def charge(payers: list[tuple[str, int | None]]) -> None:
            proxy.proxy.charge_also("family", payers)

        proxy.call(charge([("main", ANSWER * 2)]))
        body = {"model": "claude-x", "max_tokens": 10}
        replies = asyncio.run(burst(sock, 1, body)) + asyncio.run(burst(sock, 1, body))
        assert [r[0] for r in replies] == [200, 200]
        until(lambda: proxy.proxy.ledger.stats.get("main", {}).get("input_tokens")
              == 2 * USAGE[0], "both answers counted for main")
        third = asyncio.run(burst(sock, 1, body))[0]
        assert third[0] == 429 and b"mdclaw_over_budget" in third[2]
        assert len(up.requests) == 2  # main's budget stopped it before the upstream
        proxy.flush()
        rows = {(r["group_folder"], r["model"]): r["input_tokens"] + r["output_tokens"]
                for r in usage_rows(db)}
        assert rows[("main", "asked:family/claude-x")] == 2 * ANSWER
        assert rows[("family", "claude-x")] == 2 * ANSWER
        proxy.call(charge([]))
        assert asyncio.run(burst(sock, 1, body))[0][0] == 200
