"""The files a page of mdclaw's web server is made of (HTML, its script, its style sheets,
icons, a manifest), packaged with mdclaw and served from memory: one way for the chat page
and the operator page.

Both pages share one style sheet, `mdclaw/static/mdclaw.css` (the colours of light and dark
mode as CSS custom properties, the base look of text, buttons, focus, tables and cards): a
route whose file is `SHARED_STYLE` ("shared:mdclaw.css") serves it, each page under its own
URL (the chat at `/mdclaw.css`, the operator page beside its files), and the page's own
sheet, loaded after it, adds what only that page needs.

A page's Content-Security-Policy allows only scripts and styles of its own origin
(`script-src 'self'; style-src 'self'`), so the script and the style sheet are files of their
own, never inline. Every file is answered with `X-Content-Type-Options: nosniff` and
`Cache-Control: no-store` (an upgraded mdclaw is never paired with a cached old script); the
HTML file also with the page's CSP and `X-Frame-Options: DENY`.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources

from aiohttp import web

CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
                 ".webmanifest": "application/manifest+json", ".png": "image/png"}
TEXT_TYPES = frozenset({"text/html", "text/javascript", "text/css",
                        "application/manifest+json"})
# A route's file with this prefix is one of mdclaw's shared files (mdclaw/static/).
SHARED = "shared:"
SHARED_STYLE = SHARED + "mdclaw.css"


class PageAssets:
    """`routes` (a URL name -> a file in `package`'s `static/` folder, or "shared:<file>"
    for one in mdclaw's own `static/` folder), read once.

    `headers` go with every answer (they must include nosniff and no-store); `page_csp` is
    the HTML files' Content-Security-Policy."""

    def __init__(self, package: str, routes: Mapping[str, str], *,
                 headers: Mapping[str, str], page_csp: str) -> None:
        if (headers.get("X-Content-Type-Options") != "nosniff"
                or headers.get("Cache-Control") != "no-store"):
            raise ValueError("page assets are served with nosniff and no-store")
        root = resources.files(package).joinpath("static")
        shared = resources.files("mdclaw").joinpath("static")
        self._files: dict[str, tuple[bytes, str]] = {}
        for route, file in routes.items():
            suffix = file[file.rfind("."):]
            if suffix not in CONTENT_TYPES:
                raise ValueError(f"page asset {file!r}: not a kind of file a page is made of")
            source = (shared.joinpath(file.removeprefix(SHARED)) if file.startswith(SHARED)
                      else root.joinpath(file))
            self._files[route] = (source.read_bytes(), CONTENT_TYPES[suffix])
        self._headers = dict(headers)
        self._page_headers = {**headers, "Content-Security-Policy": page_csp,
                              "X-Frame-Options": "DENY"}

    @property
    def routes(self) -> frozenset[str]:
        return frozenset(self._files)

    def body(self, route: str) -> bytes:
        return self._files[route][0]

    def response(self, route: str) -> web.Response:
        """The answer for `route`; raises HTTPNotFound for a name that is not an asset."""
        if route not in self._files:
            raise web.HTTPNotFound()
        body, ctype = self._files[route]
        headers = self._page_headers if ctype == "text/html" else self._headers
        return web.Response(body=body, content_type=ctype,
                            charset="utf-8" if ctype in TEXT_TYPES else None, headers=headers)
