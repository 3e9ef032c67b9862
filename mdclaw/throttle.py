"""Wrong tokens, counted per client address: guessing the local HTTP channel's token (the
chat's bearer header, the operator page's login, /metrics) is slowed to a few tries per window.

After `max_failures` wrong tokens from one address within `window` seconds, that address is
locked out for `window` seconds: every token it presents is refused (HTTP 429 with
`Retry-After`), the right one too, so guessing cannot go on behind the refusals. A right
token outside a lockout clears the address's count. At most `max_clients` addresses are
tracked (the least recently failing one is forgotten first), so a flood of addresses cannot
grow memory. An IPv6 client is counted by its /64 network (`client_key`): one host
usually holds a whole /64, so counting single addresses would let it guess on by changing
its address (and push locked-out entries past `max_clients`). The clock is injectable for
tests.

Pure bookkeeping: it neither compares tokens nor answers requests (`mdclaw.channels.http.
TokenGate` does, with this).
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_FAILURES = 10
WINDOW_SECONDS = 300.0
MAX_CLIENTS = 4096
IPV6_PREFIX = 64  # an IPv6 client is counted by its network of this length


def client_key(address: str | None) -> str:
    """The unit wrong tokens are counted by for a peer `address`: an IPv4 address itself
    (also when IPv4-mapped), an IPv6 address its /64 network, anything else as it is."""
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip), IPV6_PREFIX), strict=False))
    return str(ip)


@dataclass
class _Client:
    failures: deque[float] = field(default_factory=deque)
    locked_until: float = 0.0


class TokenThrottle:
    """Wrong tokens per client address, and the lockouts they cause."""

    def __init__(self, *, max_failures: int = MAX_FAILURES, window: float = WINDOW_SECONDS,
                 max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_failures < 1 or window <= 0 or max_clients < 1:
            raise ValueError("max_failures, window and max_clients must be positive")
        self.max_failures = max_failures
        self.window = window
        self.max_clients = max_clients
        self.clock = clock
        self._clients: OrderedDict[str, _Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def locked(self, client: str) -> float | None:
        """Seconds until `client`'s lockout ends, or None when it is not locked out."""
        entry = self._clients.get(client)
        if entry is None:
            return None
        left = entry.locked_until - self.clock()
        return left if left > 0 else None

    def failed(self, client: str) -> float | None:
        """Count a wrong token from `client` (not locked out); the lockout's length in
        seconds when this one starts it, else None."""
        now = self.clock()
        entry = self._clients.pop(client, None) or _Client()
        self._clients[client] = entry  # the most recent last: forgotten last
        while entry.failures and entry.failures[0] <= now - self.window:
            entry.failures.popleft()
        entry.failures.append(now)
        self._trim(now)
        if len(entry.failures) < self.max_failures:
            return None
        entry.failures.clear()
        entry.locked_until = now + self.window
        return self.window

    def succeeded(self, client: str) -> None:
        """A right token from `client` (not locked out): its count starts again."""
        self._clients.pop(client, None)

    def _trim(self, now: float) -> None:
        if len(self._clients) <= self.max_clients:
            return
        # First whoever is neither locked out nor failed within the window, then the oldest.
        for key in [k for k, e in self._clients.items()
                    if e.locked_until <= now
                    and (not e.failures or e.failures[-1] <= now - self.window)]:
            del self._clients[key]
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)
