"""The files a page of mdclaw's web server is made of (HTML, one script, one style sheet),
packaged with mdclaw and served from memory: one way for the chat page and the operator page.

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

CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


class PageAssets:
    """`routes` (a URL name -> a file in `package`'s `static/` folder), read once.

    `headers` go with every answer (they must include nosniff and no-store); `page_csp` is
    the HTML files' Content-Security-Policy."""

    def __init__(self, package: str, routes: Mapping[str, str], *,
                 headers: Mapping[str, str], page_csp: str) -> None:
        if (headers.get("X-Content-Type-Options") != "nosniff"
                or headers.get("Cache-Control") != "no-store"):
            raise ValueError("page assets are served with nosniff and no-store")
        root = resources.files(package).joinpath("static")
        self._files: dict[str, tuple[bytes, str]] = {}
        for route, file in routes.items():
            suffix = file[file.rfind("."):]
            if suffix not in CONTENT_TYPES:
                raise ValueError(f"page asset {file!r}: not HTML, JavaScript or CSS")
            self._files[route] = (root.joinpath(file).read_bytes(), CONTENT_TYPES[suffix])
        self._headers = dict(headers)
        self._page_headers = {**headers, "Content-Security-Policy": page_csp,
                              "X-Frame-Options": "DENY"}

    @property
    def routes(self) -> frozenset[str]:
        return frozenset(self._files)

    def response(self, route: str) -> web.Response:
        """The answer for `route`; raises HTTPNotFound for a name that is not an asset."""
        if route not in self._files:
            raise web.HTTPNotFound()
        body, ctype = self._files[route]
        headers = self._page_headers if ctype == "text/html" else self._headers
        return web.Response(body=body, content_type=ctype, charset="utf-8", headers=headers)
