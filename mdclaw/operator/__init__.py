"""The operator's page: see and steer the running assistant from a browser.

It lives beside the local HTTP chat (a sub-application of that channel's web server, at
`/operator/`), reads and changes things only through the functions the CLI uses, and is
guarded by one access rule (`mdclaw.operator.access`). See docs/web.md.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("mdclaw.operator")


def mount_operator(d: Any) -> Any:
    """Mount the operator page on daemon `d`'s local HTTP channel (before it connects);
    returns the `Access` guarding it (for other operator routes, e.g. metrics), or None
    when the local HTTP channel is not enabled."""
    from mdclaw.channels.http import HttpChannel
    from mdclaw.operator.access import Access
    from mdclaw.operator.web import PREFIX, build_app

    http = next((ch for ch in d.channels if isinstance(ch, HttpChannel)), None)
    if http is None:
        log.info("operator page: off (the local HTTP channel is not enabled)")
        return None
    access = Access(http.gate)
    http.mount(PREFIX, build_app(d, access))
    d.operator_access = access
    return access
