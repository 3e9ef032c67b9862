"""The local HTTP chat as the daemon runs it, for tests that drive it over real sockets: the
channel's routes on a web server of its own (mdclaw.webserver), the server listening and the
channel connected; stopped in the other order."""

from __future__ import annotations

from typing import Any

from mdclaw.channels.http import HttpChannel
from mdclaw.state import Database
from mdclaw.throttle import TokenThrottle
from mdclaw.webserver import TokenGate, WebServer


def chat_on_server(db: Database, *, listen: str = "127.0.0.1:0", secret: str | None = None,
                   throttle: TokenThrottle | None = None, **kw: Any) -> HttpChannel:
    """An HttpChannel on a new web server on `listen` whose token is `secret`."""
    return HttpChannel(db, WebServer(listen, TokenGate(secret, throttle)), **kw)


async def start_chat(ch: HttpChannel) -> None:
    await ch.server.start()
    await ch.connect()


async def stop_chat(ch: HttpChannel) -> None:
    await ch.disconnect()
    await ch.server.stop()
