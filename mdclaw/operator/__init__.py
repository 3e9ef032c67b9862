"""The operator's page: see and steer the running assistant from a browser.

It is a sub-application of the daemon's web server at `/operator/` (beside the local chat
when that is on, and /metrics), sees the daemon only through mdclaw.ops.view.DaemonView,
reads and changes things only through the functions the CLI uses (mdclaw.ops), and is guarded
by one access rule (`mdclaw.operator.access`). See docs/web.md.
"""

from __future__ import annotations

from mdclaw.operator.access import Access
from mdclaw.operator.web import PREFIX, build_app
from mdclaw.ops.view import DaemonView
from mdclaw.webserver import WebServer


def mount_operator(server: WebServer, d: DaemonView) -> Access:
    """Mount the operator page over daemon `d` on the web server (before it starts); returns
    the `Access` guarding it (for other operator routes on that server: /metrics)."""
    access = Access(server.gate)
    server.mount(PREFIX, build_app(d, access))
    return access
