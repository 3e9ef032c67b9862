"""Web access for agents through the host: the off-loop actions `web_fetch` and `web_search`.

Containers run without a network; an agent asks the host instead. Policy (`web:` in the
config, docs/integrations.md): off unless `web.enabled`; per group through
`groups.<g>.actions`; domain allow/deny lists; response size, time, redirect and media-type
limits.

No server-side request forgery: every hop of a fetch (the URL and each redirect target) is
checked before anything is sent. The host name is resolved here, every address it resolves
to must be public (not loopback, private, link-local, multicast, unspecified, reserved or
otherwise non-global, nor one of this host's own addresses, nor an IPv6 form that leads to
such an IPv4 address: IPv4-mapped, 6to4, Teredo, NAT64, IPv4-compatible) unless it lies in
`web.allow_private`; then the connection goes to that checked address (aiohttp gets a
resolver pinned to it), so a DNS answer that changes between the check and the connect
(rebinding) never reaches anything else. The search provider's URL is the operator's choice
and is not subject to this rule.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from bs4 import BeautifulSoup
from markdownify import MarkdownConverter
from yarl import URL

from mdclaw.config import Web, parse_size, read_secret
from mdclaw.ipc.actions import ActionFailed, OffloopContext, action

BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
URL_MAX = 4096
QUERY_MAX = 500
REDIRECTS = (301, 302, 303, 307, 308)
HTML_TYPES = ("text/html", "application/xhtml+xml")
DROP_TAGS = ("script", "style", "noscript", "template", "svg", "canvas", "iframe", "head",
             "form", "button", "select", "input")

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to (the system's resolver unless a test gives one)
Resolver = Callable[[str, int], Awaitable[list[str]]]


class Refused(ActionFailed):
    """The policy refuses this URL or address."""


async def system_resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for info in infos:
        addr = str(info[4][0])
        if addr not in out:
            out.append(addr)
    return out


def _is_own_address(ip: IP) -> bool:
    """True if `ip` is one of this host's own addresses: binding to it succeeds only then."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((str(ip), 0))
    except OSError:
        return False
    return True


# IPv6 ranges whose addresses carry an IPv4 address a relay or translator forwards to.
# (IPv4-mapped ::ffff:0:0/96 is not here: it *is* the IPv4 address and is checked as one.)
NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # ::a.b.c.d, deprecated
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT ::ffff:0:a.b.c.d


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[tuple[str, ipaddress.IPv4Address]]:
    """The IPv4 addresses an IPv6 address leads to, each with its form ("a 6to4", ...):
    6to4 (2002::/16, bits 16-47), Teredo (2001::/32: the server in bits 32-63, the client
    in the last 32 bits XOR 0xffffffff), NAT64, IPv4-compatible and IPv4-translated."""
    out: list[tuple[str, ipaddress.IPv4Address]] = []
    if ip.sixtofour is not None:
        out.append(("a 6to4", ip.sixtofour))
    if ip.teredo is not None:
        server, client = ip.teredo
        out += [("a Teredo", server), ("a Teredo", client)]
    low32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if any(ip in n for n in NAT64):
        out.append(("a NAT64", low32))
    elif ip in IPV4_COMPATIBLE and int(ip) > 1:  # not :: or ::1
        out.append(("an IPv4-compatible", low32))
    elif ip in IPV4_TRANSLATED:
        out.append(("an IPv4-translated", low32))
    return out


def address_refusal(ip: IP, allow_private: tuple[str, ...]) -> str | None:
    """Why the host may not connect to `ip` for an agent; None if it may (the one SSRF
    rule). An IPv4-mapped address is its IPv4 address. An IPv6 address that leads to an
    IPv4 address (6to4, Teredo, NAT64...) is refused when that IPv4 address would be, and
    is allowed by `allow_private` only through a range holding the IPv6 address itself."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in ipaddress.ip_network(c) for c in allow_private):
        return None
    judged_by_ipv4 = False
    if isinstance(ip, ipaddress.IPv6Address):
        for form, inner in embedded_ipv4(ip):
            why = address_refusal(inner, ())
            if why is not None:
                return f"{ip} is {form} address leading to {inner}, and {why}"
        # A 6to4 address leads to its IPv4 address and is judged by it alone: Python 3.13
        # counts the whole of 2002::/16 as private, older ones as global.
        judged_by_ipv4 = ip.sixtofour is not None
    for test, what in ((ip.is_loopback, "a loopback"), (ip.is_link_local, "a link-local"),
                       (ip.is_multicast, "a multicast"), (ip.is_unspecified, "an unspecified"),
                       (ip.is_private, "a private"), (ip.is_reserved, "a reserved"),
                       (not ip.is_global, "a non-public")):
        if test and not judged_by_ipv4:
            return f"{ip} is {what} address"
    if _is_own_address(ip):
        return f"{ip} is one of this host's own addresses"
    return None


def _domain_matches(host: str, domains: tuple[str, ...]) -> bool:
    return any(host == d or host.endswith("." + d) for d in domains)


def url_refusal(url: URL, web: Web) -> str | None:
    """Why `url` may not be fetched by its form and its domain (before any DNS)."""
    if url.scheme not in ("http", "https"):
        return f"only http and https URLs can be fetched, not {url.scheme or 'this'!r}"
    if not url.host:
        return "the URL has no host"
    if url.user or url.password:
        return "URLs with a user name or password are not fetched"
    host = url.host.lower().rstrip(".")
    if _domain_matches(host, web.deny_domains):
        return f"{host} is in web.deny_domains"
    if web.allow_domains and not _domain_matches(host, web.allow_domains):
        return f"{host} is not in web.allow_domains"
    return None


class _PinnedResolver(AbstractResolver):
    """Answers the one checked host with the one checked address, nothing else."""

    def __init__(self, host: str, ip: IP) -> None:
        self.host, self.ip = host, ip

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        if host != self.host:
            raise OSError(f"{host} was not checked")
        fam = socket.AF_INET if self.ip.version == 4 else socket.AF_INET6
        return [ResolveResult(hostname=host, host=str(self.ip), port=port, family=fam,
                              proto=0, flags=socket.AI_NUMERICHOST)]

    async def close(self) -> None:
        return None


async def _checked_address(url: URL, web: Web, resolver: Resolver) -> IP:
    """The address to connect to for `url`, every address of its host checked."""
    assert url.host is not None
    host = url.host
    literal: IP | None
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        ips = [literal]
    else:
        try:
            answers = await resolver(host, url.port or 0)
        except OSError as e:
            raise ActionFailed(f"cannot resolve {host}: {e.strerror or e}") from None
        ips = []
        for a in answers:
            try:
                ips.append(ipaddress.ip_address(a.split("%", 1)[0]))
            except ValueError:
                continue
        if not ips:
            raise ActionFailed(f"{host} has no address")
    for ip in ips:
        why = address_refusal(ip, web.allow_private)
        if why is not None:
            raise Refused(f"refused {host}: {why} (web.allow_private can allow a range)")
    return ips[0]


def html_to_text(html: str) -> tuple[str, str | None]:
    """Readable Markdown of an HTML page (scripts, styles, forms dropped), and its title."""
    soup = BeautifulSoup(html, "html.parser")
    title = soup.title.get_text(" ", strip=True) if soup.title else None
    for tag in soup.find_all(DROP_TAGS):
        tag.decompose()
    text = MarkdownConverter(heading_style="ATX", bullets="-", strip=["img"]).convert_soup(soup)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip(), title or None


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = await resp.content.read(65536)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            return b"".join(chunks)[:limit], True


async def fetch(web: Web, url: str, max_chars: int, *,
                resolver: Resolver = system_resolve) -> dict[str, Any]:
    """Fetch `url` under the policy `web`; the web_fetch result (see module doc)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + web.timeout.total_seconds()
    try:
        current = URL(url)
    except ValueError:
        raise ActionFailed(f"not a URL: {url[:200]!r}") from None
    redirects = 0
    max_bytes = parse_size(web.max_bytes)
    while True:
        why = url_refusal(current, web)
        if why is not None:
            raise Refused(f"refused {str(current)[:200]}: {why}")
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise ActionFailed(f"took longer than web.timeout ({web.timeout.total_seconds():g} s)")
        try:
            async with asyncio.timeout(remaining):
                ip = await _checked_address(current, web, resolver)
                assert current.host is not None
                connector = aiohttp.TCPConnector(
                    resolver=_PinnedResolver(current.host, ip), use_dns_cache=False,
                    force_close=True)
                async with aiohttp.ClientSession(connector=connector) as session, \
                        session.get(current, allow_redirects=False, headers={
                            "User-Agent": web.user_agent,
                            "Accept": ", ".join(web.content_types) + ";q=0.9, */*;q=0.1",
                        }) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in REDIRECTS and location:
                        if redirects >= web.max_redirects:
                            raise ActionFailed(f"more than web.max_redirects "
                                               f"({web.max_redirects}) redirects")
                        try:
                            current = current.join(URL(location))
                        except ValueError:
                            raise ActionFailed("a redirect to an invalid URL") from None
                        redirects += 1
                        continue
                    ctype = resp.content_type.lower()
                    if ctype not in web.content_types:
                        raise Refused(f"content type {ctype!r} is not in web.content_types")
                    body, truncated = await _read_bounded(resp, max_bytes)
                    charset = resp.charset or "utf-8"
                    status, final = resp.status, str(resp.url)
        except TimeoutError:
            raise ActionFailed(f"took longer than web.timeout "
                               f"({web.timeout.total_seconds():g} s)") from None
        except aiohttp.ClientError as e:
            raise ActionFailed(f"fetching {str(current)[:200]} failed: "
                               f"{type(e).__name__}: {e}") from None
        try:
            text = body.decode(charset, errors="replace")
        except LookupError:
            text = body.decode("utf-8", errors="replace")
        title = None
        if ctype in HTML_TYPES:
            text, title = html_to_text(text)
        if len(text) > max_chars:
            text, truncated = text[:max_chars], True
        out: dict[str, Any] = {"url": url, "final_url": final, "status": status,
                               "content_type": ctype, "text": text, "truncated": truncated}
        if title:
            out["title"] = title
        return out


def _web(ctx: OffloopContext) -> Web:
    web = ctx.cfg.web
    if not web.enabled:
        raise ActionFailed("web access is off on this host (web.enabled in the config)")
    return web


def _whole(params: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ActionFailed(f"{key} must be a whole number from {low} to {high}")
    return value


@action("web_fetch", offloop=True, default_scope="all", max_attempts=3, timeout=300)
async def web_fetch(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """{url, max_chars?} -> {url, final_url, status, content_type, text, truncated, title?}"""
    web = _web(ctx)
    url = params.get("url")
    if not isinstance(url, str) or not url.strip() or len(url) > URL_MAX:
        raise ActionFailed(f"web_fetch needs a string 'url' of at most {URL_MAX} characters")
    # More than web.max_chars is cut to it (the tool says "the host caps it"), not refused.
    max_chars = min(_whole(params, "max_chars", web.max_chars, 1, 1_000_000), web.max_chars)
    return await fetch(web, url.strip(), max_chars)


def _plain(text: Any) -> str:
    if not isinstance(text, str):
        return ""
    return BeautifulSoup(text, "html.parser").get_text(" ", strip=True)[:1000]


async def search(web: Web, query: str, count: int) -> list[dict[str, str]]:
    """Results {title, url, snippet} of `query` from the configured provider."""
    cfg = web.search
    if cfg is None:
        raise ActionFailed("no search provider is configured (web.search in the config)")
    headers = {"User-Agent": web.user_agent, "Accept": "application/json"}
    if cfg.provider == "searxng":
        assert cfg.url is not None
        url = URL(cfg.url.rstrip("/") + "/search").with_query(q=query, format="json")
    else:
        assert cfg.api_key_file is not None
        try:
            headers["X-Subscription-Token"] = read_secret(cfg.api_key_file)
        except OSError:
            raise ActionFailed("the search provider's key file cannot be read") from None
        url = URL(cfg.url or BRAVE_URL).with_query(q=query, count=str(count))
    try:
        async with asyncio.timeout(web.timeout.total_seconds()), \
                aiohttp.ClientSession() as session, \
                session.get(url, headers=headers, allow_redirects=False) as resp:
            body, truncated = await _read_bounded(resp, parse_size(web.max_bytes))
            status = resp.status
    except TimeoutError:
        raise ActionFailed("the search provider did not answer in time") from None
    except aiohttp.ClientError as e:
        raise ActionFailed(f"the search provider cannot be reached: {type(e).__name__}") from None
    if status != 200:
        raise ActionFailed(f"the search provider answered HTTP {status}")
    try:
        data = json.loads(body) if not truncated else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise ActionFailed("the search provider's answer is not the JSON expected")
    if cfg.provider == "searxng":
        raw = data.get("results") or []
        items = [(r.get("title"), r.get("url"), r.get("content")) for r in raw
                 if isinstance(r, dict)]
    else:
        raw = (data.get("web") or {}).get("results") or []
        items = [(r.get("title"), r.get("url"), r.get("description")) for r in raw
                 if isinstance(r, dict)]
    out = [{"title": _plain(t), "url": u, "snippet": _plain(s)}
           for t, u, s in items if isinstance(u, str) and u.startswith(("http://", "https://"))]
    return out[:count]


@action("web_search", offloop=True, default_scope="all", max_attempts=3, timeout=300)
async def web_search(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """{query, count?} -> {query, results: [{title, url, snippet}]}"""
    web = _web(ctx)
    query = params.get("query")
    if not isinstance(query, str) or not query.strip() or len(query) > QUERY_MAX:
        raise ActionFailed(f"web_search needs a non-empty string 'query' of at most "
                           f"{QUERY_MAX} characters")
    limit = web.search.max_results if web.search else 10
    count = _whole(params, "count", min(5, limit), 1, limit)
    return {"query": query.strip(), "results": await search(web, query.strip(), count)}
