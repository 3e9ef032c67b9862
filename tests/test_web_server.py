"""The daemon owns the web server (`server:`): with the local HTTP chat off, a real daemon
still serves the operator page and /metrics on it, the chat's routes are not there, and the
one token guards all of it; `server: null` serves nothing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from operator_helpers import free_port, running_daemon

TOKEN = "web-server-test-token"

CONFIG = """\
data_dir: {data_dir}
assistant: {{name: Andy, timezone: UTC}}
groups:
  main: {{name: Admin, jid: "tg:1", main: true}}
{server}
channels:
  http: {{enabled: false}}
"""


def write_config(tmp_path: Path, server: str) -> Path:
    token = tmp_path / "web.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(data_dir=tmp_path / "data",
                                 server=server.replace("TOKEN_FILE", str(token))))
    return cfg


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_page_and_metrics_answer_without_the_chat(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = write_config(tmp_path, f'server: {{listen: "127.0.0.1:{port}", '
                                 "secret_file: TOKEN_FILE}")
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    ready = urllib.request.Request(f"{base}/operator/api/session", headers=bearer)
    with running_daemon(cfg, port, ready=ready):
        # the operator page, behind the token
        status, page = get(f"{base}/operator/")
        assert status == 200 and "Log in" in page
        assert get(f"{base}/operator/api/overview")[0] == 401
        status, body = get(f"{base}/operator/api/overview", bearer)
        assert status == 200, body
        overview = json.loads(body)
        assert overview["channels"] == []  # no chat: the page says so, and works
        assert overview["daemon"]["groups"] == 1
        # /metrics beside it, behind the same token
        assert get(f"{base}/metrics")[0] == 401
        status, text = get(f"{base}/metrics", bearer)
        assert status == 200 and "mdclaw_outbox_rows" in text
        assert 'mdclaw_channel_connected{channel="http"}' not in text
        # the chat's routes are not there (and an unknown path needs the token to say so)
        assert get(f"{base}/health")[0] == 401
        for path in ("/health", "/messages?jid=hl:main", "/", "/chat.js"):
            assert get(f"{base}{path}", bearer)[0] == 404, path


def test_without_a_token_the_page_answers_loopback_clients(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg = write_config(tmp_path, f'server: {{listen: "127.0.0.1:{port}"}}')
    with running_daemon(cfg, port, ready=f"{base}/operator/api/session"):
        status, body = get(f"{base}/operator/api/groups")
        assert status == 200 and [g["folder"] for g in json.loads(body)] == ["main"]
        assert get(f"{base}/metrics")[0] == 200
        # the server's host check holds for the page too (no DNS rebinding)
        assert get(f"{base}/operator/api/groups", {"Host": f"evil.example:{port}"})[0] == 403


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (from /proc: its sockets' inodes)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    inodes = set()
    for fd in fd_dir.iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_no_web_server(tmp_path: Path) -> None:
    metrics_port = free_port()
    cfg = write_config(tmp_path, f'server: null\nmetrics: {{listen: "127.0.0.1:{metrics_port}"}}')
    with running_daemon(cfg, metrics_port,
                        ready=f"http://127.0.0.1:{metrics_port}/metrics") as proc:
        # the daemon listens on the metrics listener of its own, and on nothing else
        assert listening_ports(proc.pid) == {metrics_port}
        # which answers loopback clients (without a web server there is no token)
        assert get(f"http://127.0.0.1:{metrics_port}/metrics")[0] == 200
