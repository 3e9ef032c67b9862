"""What a (re)start of the NixOS service costs with the agent image already loaded.

1. `full_load_s`: `mdclaw image load --force` of a saved agent image (what every start paid
   before the pre-start learned to skip a loaded image).
2. `skipped_load_s`: `mdclaw image load` of the same tarball, already in the engine (the
   pre-start now: read the tarball's manifest, ask the engine, upload nothing).
3. `restart_to_ready_s`: skipped load, then `mdclaw run` until it tells systemd READY=1 (a
   real NOTIFY_SOCKET), as `systemctl restart mdclaw` does; the worst of --n runs.

Needs a live engine (DOCKER_HOST) holding IMAGE (default mdclaw-agent:e2e).
Usage: python bench/image_load.py [--image mdclaw-agent:e2e] [--n 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def mdclaw(*args: str, env: dict[str, str] | None = None) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "mdclaw", *args], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


def restart_to_ready(config: Path, tarball: Path, tmp: Path) -> float:
    sock_path = tmp / "notify.sock"
    sock_path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(120)
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "mdclaw", "image", "load", str(tarball), "--config",
                    str(config)], check=True, env=env, stdout=subprocess.DEVNULL)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(config)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            msg = sock.recv(4096).decode()
            if "READY=1" in msg.split("\n"):
                return time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        sock.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="mdclaw-agent:e2e")
    ap.add_argument("--n", type=int, default=3)
    a = ap.parse_args()
    from mdclaw.runtime import find_socket
    from mdclaw.runtime.docker_engine import DockerRuntime

    url = os.environ.get("DOCKER_HOST") or find_socket()
    rt = DockerRuntime(url, engine="podman" if "podman" in url else "docker")
    with tempfile.TemporaryDirectory(prefix="mdclaw-bench-load-") as d:
        tmp = Path(d)
        tarball = tmp / "image.tar"
        with open(tarball, "wb") as f:
            for chunk in rt._api().get_image(a.image):
                f.write(chunk)
        config = tmp / "config.yaml"
        config.write_text(
            f"data_dir: {tmp / 'data'}\nruntime:\n  socket: \"{url}\"\n  image: \"{a.image}\"\n"
            "groups:\n  main:\n    name: Admin\n    jid: \"hl:main\"\n    main: true\n"
            "channels:\n  http:\n    listen: \"127.0.0.1:0\"\n")
        full = mdclaw("image", "load", "--force", str(tarball), "--config", str(config))
        skipped = min(mdclaw("image", "load", str(tarball), "--config", str(config))
                      for _ in range(a.n))
        ready = [restart_to_ready(config, tarball, tmp) for _ in range(a.n)]
        print(json.dumps({"image": a.image, "tarball_mb": round(tarball.stat().st_size / 1e6),
                          "full_load_s": round(full, 2), "skipped_load_s": round(skipped, 2),
                          "restart_to_ready_s": round(max(ready), 2),
                          "restart_to_ready_runs": [round(r, 2) for r in ready]}))


if __name__ == "__main__":
    main()
