"""web_fetch and web_search against real local aiohttp servers: the SSRF rule (loopback,
private, redirects, DNS rebinding), the limits, and fake SearXNG / Brave providers."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web as aioweb

from ipc_helpers import Env
from mdclaw.config import Web, WebSearch
from mdclaw.integrations import load_all
from mdclaw.integrations.web import Refused, address_refusal, fetch, search
from mdclaw.ipc.actions import ActionFailed

PAGE = """<html><head><title>Garden notes</title><style>body{color:red}</style>
<script>steal()</script></head><body><h1>Tomatoes</h1><p>Water them <b>daily</b>.</p>
<ul><li>basil</li><li>chives</li></ul></body></html>"""


@asynccontextmanager
async def serve(routes: dict[str, Callable[..., Any]], host: str = "127.0.0.1",
                port: int = 0) -> AsyncIterator[tuple[int, list[str]]]:
    """A real aiohttp server; yields (port, paths requested)."""
    hits: list[str] = []
    app = aioweb.Application()

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def handler(request: aioweb.Request) -> aioweb.StreamResponse:
            hits.append(request.path_qs)
            return await fn(request)
        return handler

    for path, fn in routes.items():
        app.router.add_get(path, wrap(fn))
    runner = aioweb.AppRunner(app)
    await runner.setup()
    site = aioweb.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    assert server is not None
    real_port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield real_port, hits
    finally:
        await runner.cleanup()


def page(text: str = PAGE, ctype: str = "text/html") -> Callable[..., Any]:
    async def h(request: aioweb.Request) -> aioweb.Response:
        return aioweb.Response(text=text, content_type=ctype)
    return h


def redirect(to: Callable[[], str]) -> Callable[..., Any]:
    async def h(request: aioweb.Request) -> aioweb.Response:
        raise aioweb.HTTPFound(to())
    return h


def policy(**kw: Any) -> Web:
    return Web(enabled=True, **kw)


def resolver(answers: dict[str, list[list[str]]], calls: list[str]) -> Any:
    """A DNS resolver answering each host with its next answer in turn."""
    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        seq = answers[host]
        return seq.pop(0) if len(seq) > 1 else seq[0]
    return resolve


def test_an_allowed_page_returns_its_text() -> None:
    async def go() -> dict[str, Any]:
        async with serve({"/garden": page()}) as (port, _):
            return await fetch(policy(allow_private=("127.0.0.1/32",)),
                               f"http://127.0.0.1:{port}/garden", 10_000)
    r = asyncio.run(go())
    assert r["status"] == 200 and r["content_type"] == "text/html" and not r["truncated"]
    assert r["title"] == "Garden notes"
    assert "# Tomatoes" in r["text"] and "Water them **daily**." in r["text"]
    assert "- basil" in r["text"] and "steal" not in r["text"] and "color" not in r["text"]
    assert r["final_url"] == r["url"]


@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/garden", "http://[::1]:{port}/x",
                                 "http://10.1.2.3/", "http://192.168.1.1/", "http://0.0.0.0/",
                                 "http://169.254.169.254/latest/meta-data/",
                                 "http://[::ffff:127.0.0.1]:{port}/garden"])
def test_loopback_and_private_addresses_are_refused(url: str) -> None:
    async def go() -> list[str]:
        async with serve({"/garden": page()}) as (port, hits):
            with pytest.raises(Refused, match="loopback|private|unspecified|link-local"):
                await fetch(policy(), url.format(port=port), 1000)
            return hits
    assert asyncio.run(go()) == []


def test_a_name_resolving_to_a_private_address_is_refused() -> None:
    calls: list[str] = []
    res = resolver({"nas.example": [["192.168.1.10"]], "mixed.example": [
        ["93.184.216.34", "10.0.0.5"]]}, calls)

    async def go() -> None:
        with pytest.raises(Refused, match="192.168.1.10 is a private address"):
            await fetch(policy(), "http://nas.example/", 1000, resolver=res)
        # One bad answer among good ones is enough to refuse.
        with pytest.raises(Refused, match="10.0.0.5"):
            await fetch(policy(), "http://mixed.example/", 1000, resolver=res)
    asyncio.run(go())


# IPv6 addresses that lead to an IPv4 address: 6to4 (2002:AABB:CCDD::), Teredo (the client
# is the last 32 bits XOR 0xffffffff: 80ff:fffe is 127.0.0.1), NAT64, IPv4-compatible and
# IPv4-translated forms. Each embeds a loopback, private or link-local IPv4 address.
TUNNELLED = [
    ("2002:7f00:1::", "a 6to4 address leading to 127.0.0.1"),
    ("2002:c0a8:10a::1", "a 6to4 address leading to 192.168.1.10"),
    ("2002:a9fe:a9fe::", "a 6to4 address leading to 169.254.169.254"),
    ("2002:a00:5::", "a 6to4 address leading to 10.0.0.5"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "127.0.0.1"),
    ("2001:0:4136:e378:8000:63bf:3f57:fef5", "192.168.1.10"),
    ("2001:0:7f00:1:8000:63bf:f7f7:f7f7", "127.0.0.1"),
    ("64:ff9b::c0a8:10a", "192.168.1.10"),
    ("::127.0.0.1", "127.0.0.1"),
    ("::ffff:0:c0a8:10a", "192.168.1.10"),
]


@pytest.mark.parametrize(("address", "why"), TUNNELLED)
def test_ipv6_forms_of_private_ipv4_addresses_are_refused(address: str, why: str) -> None:
    """As a literal in the URL, as the answer for a name, and as a redirect target: nothing
    is sent, and the refusal names the IPv4 address the IPv6 one leads to."""
    calls: list[str] = []
    res = resolver({"tunnel.example": [[address]]}, calls)

    async def go() -> list[str]:
        async with serve({"/secret": page("<p>SECRET</p>")}) as (port, hits), \
                serve({"/go": redirect(lambda: f"http://[{address}]:{port}/secret")},
                      host="127.0.0.2") as (hop_port, _):
            with pytest.raises(Refused, match=re.escape(why)):
                await fetch(policy(), f"http://[{address}]:{port}/secret", 1000)
            with pytest.raises(Refused, match=re.escape(why)):
                await fetch(policy(), f"http://tunnel.example:{port}/secret", 1000,
                            resolver=res)
            with pytest.raises(Refused, match=re.escape(why)):
                await fetch(policy(allow_private=("127.0.0.2/32",)),
                            f"http://127.0.0.2:{hop_port}/go", 1000)
            return hits
    assert asyncio.run(go()) == []
    assert calls == ["tunnel.example"]


def test_ipv6_forms_are_judged_by_the_ipv4_address_they_lead_to() -> None:
    """The one rule: a 6to4 address of a public IPv4 address passes like that address;
    web.allow_private allows a tunnelled form only through a range holding the IPv6 address
    itself (allowing 127.0.0.0/8 does not open 2002:7f00::/24)."""
    def why(a: str, allow: tuple[str, ...] = ()) -> str | None:
        return address_refusal(ipaddress.ip_address(a), allow)
    assert why("2002:808:808::1") is None  # 6to4 of 8.8.8.8
    assert why("2606:4700:4700::1111") is None  # native IPv6
    assert why("93.184.216.34") is None
    assert why("2002:7f00:1::", ("127.0.0.0/8",)) is not None
    assert why("2002:7f00:1::", ("2002:7f00::/24",)) is None
    assert why("::ffff:192.168.1.10", ("192.168.0.0/16",)) is None  # mapped: the IPv4 itself
    assert "loopback" in (why("::ffff:127.0.0.1") or "")


def test_dns_rebinding_cannot_reach_the_second_answer() -> None:
    """The resolver answers an allowed address first, then 127.0.0.1: the fetch asks once
    and connects to the checked address; the loopback server never sees a request."""
    async def go() -> tuple[dict[str, Any], list[str], list[str], list[str]]:
        async with serve({"/": page("<p>the allowed one</p>")}, host="127.0.0.2") as (
                port, good_hits), \
                serve({"/": page("<p>SECRET</p>")}, port=port) as (_, secret_hits):
            calls: list[str] = []
            res = resolver({"rebind.example": [["127.0.0.2"], ["127.0.0.1"]]}, calls)
            r = await fetch(policy(allow_private=("127.0.0.2/32",)),
                            f"http://rebind.example:{port}/", 1000, resolver=res)
            # And when the first answer is the bad one, it is refused outright.
            with pytest.raises(Refused, match="127.0.0.1 is a loopback"):
                await fetch(policy(allow_private=("127.0.0.2/32",)),
                            f"http://rebind.example:{port}/", 1000, resolver=res)
            return r, good_hits, secret_hits, calls
    r, good, secret, calls = asyncio.run(go())
    assert "the allowed one" in r["text"] and "SECRET" not in r["text"]
    assert good == ["/"] and secret == []
    assert calls == ["rebind.example", "rebind.example"]  # once per fetch, no second lookup


def test_a_redirect_to_a_private_address_is_refused() -> None:
    async def go() -> list[str]:
        async with serve({"/secret": page("<p>SECRET</p>")}) as (lo_port, lo_hits), \
                serve({"/go": redirect(lambda: f"http://127.0.0.1:{lo_port}/secret")},
                      host="127.0.0.2") as (port, _):
            with pytest.raises(Refused, match="127.0.0.1 is a loopback"):
                await fetch(policy(allow_private=("127.0.0.2/32",)),
                            f"http://127.0.0.2:{port}/go", 1000)
            return lo_hits
    assert asyncio.run(go()) == []


def test_redirects_are_followed_within_the_limit() -> None:
    async def go() -> tuple[dict[str, Any], str]:
        async with serve({"/a": redirect(lambda: "/b"), "/b": redirect(lambda: "/c"),
                          "/c": page("<p>end</p>")}) as (port, _):
            web = policy(allow_private=("127.0.0.0/8",), max_redirects=2)
            ok = await fetch(web, f"http://127.0.0.1:{port}/a", 1000)
            with pytest.raises(ActionFailed, match="more than web.max_redirects"):
                await fetch(web.model_copy(update={"max_redirects": 1}),
                            f"http://127.0.0.1:{port}/a", 1000)
            return ok, f"http://127.0.0.1:{port}/c"
    ok, final = asyncio.run(go())
    assert ok["final_url"] == final and ok["text"] == "end"


def test_size_caps_and_content_types() -> None:
    big = "<p>" + "x" * 200_000 + "</p>"

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with serve({"/big": page(big), "/img": page("PNG", "image/png"),
                          "/txt": page("a" * 5000, "text/plain")}) as (port, _):
            web = policy(allow_private=("127.0.0.0/8",), max_bytes="10KiB")
            capped = await fetch(web, f"http://127.0.0.1:{port}/big", 100_000)
            chars = await fetch(web, f"http://127.0.0.1:{port}/txt", 100)
            with pytest.raises(Refused, match="image/png"):
                await fetch(web, f"http://127.0.0.1:{port}/img", 1000)
            return capped, chars
    capped, chars = asyncio.run(go())
    assert capped["truncated"] and len(capped["text"]) <= 10 * 1024
    assert chars["truncated"] and chars["text"] == "a" * 100


def test_domain_lists() -> None:
    calls: list[str] = []
    res = resolver({"blog.good.example": [["127.0.0.2"]], "evil.example": [["127.0.0.2"]],
                    "x.good.example": [["127.0.0.2"]]}, calls)

    async def go() -> dict[str, Any]:
        async with serve({"/": page("<p>hello</p>")}, host="127.0.0.2") as (port, _):
            web = policy(allow_private=("127.0.0.2/32",), allow_domains=("good.example",),
                         deny_domains=("x.good.example",))
            with pytest.raises(Refused, match="not in web.allow_domains"):
                await fetch(web, f"http://evil.example:{port}/", 1000, resolver=res)
            with pytest.raises(Refused, match="in web.deny_domains"):
                await fetch(web, f"http://x.good.example:{port}/", 1000, resolver=res)
            with pytest.raises(Refused, match="only http and https"):
                await fetch(web, "file:///etc/passwd", 1000, resolver=res)
            return await fetch(web, f"http://blog.good.example:{port}/", 1000, resolver=res)
    assert asyncio.run(go())["text"] == "hello"
    assert calls == ["blog.good.example"]  # refused names are never even resolved


def test_searxng_provider() -> None:
    async def results(request: aioweb.Request) -> aioweb.Response:
        assert request.query["format"] == "json"
        return aioweb.json_response({"results": [
            {"title": "Tomato care", "url": "https://a.example/t", "content": "Water <b>daily</b>"},
            {"title": "bad", "url": "javascript:alert(1)", "content": ""},
            {"title": "Basil", "url": "https://b.example/b", "content": "Sun"}]})

    async def go() -> tuple[list[dict[str, str]], list[str]]:
        async with serve({"/search": results}) as (port, hits):
            web = policy(search=WebSearch(provider="searxng", url=f"http://127.0.0.1:{port}/"))
            return await search(web, "tomato care", 5), hits
    found, hits = asyncio.run(go())
    assert found == [{"title": "Tomato care", "url": "https://a.example/t",
                      "snippet": "Water daily"},
                     {"title": "Basil", "url": "https://b.example/b", "snippet": "Sun"}]
    assert hits == ["/search?q=tomato+care&format=json"]


def test_brave_provider_sends_the_key_and_never_logs_it(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    key = tmp_path / "brave.key"
    key.write_text("sekrit-token-123\n")
    key.chmod(0o600)
    seen: list[str | None] = []

    async def results(request: aioweb.Request) -> aioweb.Response:
        seen.append(request.headers.get("X-Subscription-Token"))
        if request.headers.get("X-Subscription-Token") != "sekrit-token-123":
            return aioweb.json_response({}, status=401)
        return aioweb.json_response({"web": {"results": [
            {"title": "Tomato", "url": "https://t.example/", "description": "<strong>Red</strong>"}
        ][: int(request.query["count"])]}})

    async def go() -> tuple[list[dict[str, str]], str]:
        async with serve({"/res/v1/web/search": results}) as (port, _):
            url = f"http://127.0.0.1:{port}/res/v1/web/search"
            web = policy(search=WebSearch(provider="brave", url=url, api_key_file=key))
            found = await search(web, "tomato", 3)
            key.write_text("wrong\n")
            with pytest.raises(ActionFailed) as e:
                await search(web, "tomato", 3)
            return found, str(e.value)
    caplog.set_level(logging.DEBUG)
    found, err = asyncio.run(go())
    assert found == [{"title": "Tomato", "url": "https://t.example/", "snippet": "Red"}]
    assert seen == ["sekrit-token-123", "wrong"]
    assert err == "the search provider answered HTTP 401"
    assert "sekrit" not in caplog.text and "sekrit" not in err


# ------------------------------------------------------------------ through the IPC engine

@pytest.fixture
def web_env(tmp_path: Path) -> Iterator[Env]:
    load_all()
    e = Env(tmp_path, family="    actions: ['web_search']\n", extra="""
        web:
          enabled: true
          allow_private: ['127.0.0.2/32']
        """)
    yield e
    e.close()


def test_web_fetch_as_an_action_request(web_env: Env) -> None:
    from test_action_worker import Running, request, result
    from waiting import wait_until_async

    env = web_env

    async def go() -> None:
        async with serve({"/p": page()}, host="127.0.0.2") as (port, _), \
                serve({"/p": page()}) as (lo_port, lo_hits), Running(env):
            env.write("work", request("f1", "web_fetch", url=f"http://127.0.0.2:{port}/p"),
                      sub="actions")
            env.write("work", request("f2", "web_fetch", url=f"http://127.0.0.1:{lo_port}/p"),
                      sub="actions")
            env.write("family", request("f3", "web_fetch", url=f"http://127.0.0.2:{port}/p"),
                      sub="actions")
            # More than web.max_chars (20,000 by default) is capped, not refused.
            env.write("work", request("f4", "web_fetch", url=f"http://127.0.0.2:{port}/p",
                                      max_chars=1_000_000), sub="actions")
            env.write("work", request("f5", "web_fetch", url=f"http://127.0.0.2:{port}/p",
                                      max_chars=0), sub="actions")
            await wait_until_async(lambda: all(result(env, g, r) for g, r in
                                               (("work", "f1"), ("work", "f2"), ("family", "f3"),
                                                ("work", "f4"), ("work", "f5"))))
            assert lo_hits == []
    asyncio.run(go())
    ok = result(env, "work", "f1")
    assert ok is not None and ok["status"] == "success" and "# Tomatoes" in ok["result"]["text"]
    bad = result(env, "work", "f2")
    assert bad is not None and bad["status"] == "error" and "loopback" in bad["error"]
    refused = result(env, "family", "f3")
    assert refused is not None and "groups.family.actions (web_search)" in refused["error"]
    capped, zero = result(env, "work", "f4"), result(env, "work", "f5")
    assert capped is not None and capped["status"] == "success", capped
    assert capped["result"]["text"] == ok["result"]["text"]
    assert zero is not None and zero["error"] == "max_chars must be a whole number from 1 to " \
        "1000000"


def test_web_is_off_by_default(tmp_path: Path) -> None:
    from test_action_worker import Running, request, result
    from waiting import wait_until_async

    load_all()
    env = Env(tmp_path)
    try:
        async def go() -> None:
            async with Running(env):
                env.write("work", request("o1", "web_search", query="x"), sub="actions")
                await wait_until_async(lambda: result(env, "work", "o1"))
        asyncio.run(go())
        r = result(env, "work", "o1")
        assert r is not None and "web access is off" in r["error"]
    finally:
        env.close()


def test_loopback_socket_helper_sanity() -> None:
    """127.0.0.2 must be bindable for these tests (Linux routes all of 127/8 to lo)."""
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))


# ------------------------------------------------------- the container's tools on host results

def test_container_tools_format_real_host_results(tmp_path: Path) -> None:
    """The container-side web_fetch and web_search tools, fed the results this host's
    handlers really produce (fetch and search against local servers, the request's own
    params): the keys the tools read (text, final_url, status, content_type, truncated,
    title; results of title, url, snippet) are the keys the host writes."""
    import agent_helpers  # noqa: F401 - puts the runner package on sys.path
    from mdclaw_agent.ipc import write_json_atomic
    from mdclaw_agent.tools import ToolContext, run_tool, tools_for

    (tmp_path / "group").mkdir()
    ipc = tmp_path / "ipc"
    ctx = ToolContext(ipc_dir=ipc, group_folder="family", chat_jid="tg:2", is_main=False,
                      group_dir=tmp_path / "group", action_timeout=10.0, web_timeout=10.0)
    tools = tools_for(False)

    async def searx(request: aioweb.Request) -> aioweb.Response:
        return aioweb.json_response({"results": [
            {"title": "Basil <b>care</b>", "url": "https://example.org/basil",
             "content": "Water <em>basil</em> daily."}]})

    async def go() -> list[tuple[str, bool]]:
        async with serve({"/p": page(), "/moved": redirect(lambda: "/p"),
                          "/long": page("<p>" + "word " * 200 + "</p>"),
                          "/search": searx}) as (port, _):
            pol = policy(allow_private=("127.0.0.1/32",), search=WebSearch(
                provider="searxng", url=f"http://127.0.0.1:{port}"))
            stop = asyncio.Event()

            async def host() -> None:  # answers each request with the real handler's result
                while not stop.is_set():
                    for p in sorted((ipc / "actions").glob("*.json")) \
                            if (ipc / "actions").is_dir() else []:
                        body = json.loads(p.read_text())
                        p.unlink()
                        params = body["params"]
                        if body["action"] == "web_fetch":
                            result = await fetch(pol, params["url"],
                                                 params.get("max_chars", pol.max_chars))
                        else:
                            result = {"query": params["query"], "results": await search(
                                pol, params["query"], params.get("count", 5))}
                        write_json_atomic(ipc / "action_results",
                                          {"requestId": body["request_id"],
                                           "status": "success", "result": result},
                                          f"{body['request_id']}.json")
                    await asyncio.sleep(0.005)

            answering = asyncio.create_task(host())
            try:
                return [await asyncio.to_thread(run_tool, tools, ctx, name, args)
                        for name, args in (
                            ("web_fetch", {"url": f"http://127.0.0.1:{port}/moved"}),
                            ("web_fetch", {"url": f"http://127.0.0.1:{port}/long",
                                           "max_chars": 100}),
                            ("web_search", {"query": "basil", "count": 3}))]
            finally:
                stop.set()
                await answering

    (full, ok1), (cut, ok2), (found, ok3) = asyncio.run(go())
    assert not (ok1 or ok2 or ok3), (full, cut, found)
    head, title, blank, *body = full.splitlines()
    assert head.startswith("http://127.0.0.1:") and head.endswith("/p (HTTP 200, text/html)")
    assert title == "Title: Garden notes" and blank == ""
    assert "- basil" in body and "- chives" in body
    assert "[truncated by the host" not in full
    assert cut.endswith("\n[truncated by the host; ask with a larger max_chars for more]")
    assert cut.split("\n\n", 1)[1].rsplit("\n[", 1)[0] == ("word " * 20)[:100]
    assert found == ("1 web result(s) for 'basil':\n1. Basil care\n   https://example.org/basil"
                     "\n   Water basil daily.")
