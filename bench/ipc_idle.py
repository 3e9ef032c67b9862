"""CPU used by the IPC loop while nothing happens: 100 groups, 60 s, inotify on (and, for
comparison, polling only). The poll (1 s) still runs in both; folders whose mtime did not
change are not listed again.

    python bench/ipc_idle.py [--seconds 60] [--groups 100] [--no-inotify]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from ipc_common import cpu_seconds, emit, make_data_dir, serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--no-inotify", action="store_true")
    ap.add_argument("--poll", type=float, default=1.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = make_data_dir(Path(tmp), args.groups)
        server = serve(cfg, inotify=not args.no_inotify, poll=args.poll)
        try:
            time.sleep(2)  # let start-up settle (first poll lists every folder once)
            c0 = cpu_seconds(server.pid)
            time.sleep(args.seconds)
            cpu = cpu_seconds(server.pid) - c0
        finally:
            server.stop()
    emit("ipc_idle_cpu", cpu, "s", seconds=args.seconds, groups=args.groups,
         mode="polling only" if args.no_inotify else "inotify", poll_s=args.poll)


if __name__ == "__main__":
    main()
