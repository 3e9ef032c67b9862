"""`python tests/fake_daemon.py --config FILE --agent MODULE:SCRIPT [--die-at POINT]`: the
daemon exactly as `mdclaw run` starts it, with the tests' fake engine (tests/fake_engine.py)
in place of the container engine, its containers running SCRIPT (a function of a module in
tests/).

For tests that need a real process around the orchestrator: one they stop with SIGTERM or
SIGKILL, start again on the same data, and watch from outside.

--die-at POINT[=UID]: the email channel kills its own process (SIGKILL) at that point of
taking a mail (the mail with that UID, or any): `before-seen` (the host has stored the mail;
it is not yet marked \\Seen), `before-uid` (marked \\Seen; its UID not yet saved).
--fast-reconnect: the email channel connects again after 0.5 s doubling to 2 s (instead of up
to 5 min), so an outage test waits for the outage, not for the backoff.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def _die(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--agent", required=True, help="MODULE:FUNCTION, the containers' script")
    p.add_argument("--die-at", metavar="POINT[=UID]")
    p.add_argument("--fast-reconnect", action="store_true")
    args = p.parse_args()

    import mdclaw.daemon.core as core
    from fake_engine import FakeEngine
    from mdclaw.channels.base import SavedPosition
    from mdclaw.channels.email import EmailChannel
    from mdclaw.cli import main as cli_main
    from mdclaw.retry import Backoff

    module, _, name = args.agent.partition(":")
    script = getattr(importlib.import_module(module), name)
    core.create_runtime = lambda _runtime: FakeEngine(default=script)  # type: ignore[assignment]
    point, _, at_uid = (args.die_at or "").partition("=")

    def dying(uid: int) -> bool:
        return uid != 0 and (not at_uid or uid == int(at_uid))  # 0: an empty mailbox's start

    if point == "before-seen":
        mark = EmailChannel._mark_seen

        def die_before_seen(box: Any, uid: int) -> None:
            if dying(uid):
                _die()
            mark(box, uid)

        EmailChannel._mark_seen = staticmethod(die_before_seen)  # type: ignore[method-assign]
    elif point == "before-uid":
        write = SavedPosition._write  # the email channel's last UID is one of these

        def die_before_uid(self: SavedPosition, ask: int, value: str) -> None:
            if self.channel == "email" and dying(int(value.split()[1])):
                _die()
            write(self, ask, value)

        SavedPosition._write = die_before_uid  # type: ignore[method-assign]
    if args.fast_reconnect:
        EmailChannel.reconnect_backoff = Backoff(base=0.5, factor=2.0, cap=2.0)
    return cli_main(["run", "--config", args.config])


if __name__ == "__main__":
    sys.exit(main())
