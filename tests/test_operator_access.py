"""Who may use the operator page, against a real daemon: the channel's token as a bearer
header or through a login's session cookie; without a token, loopback peers only; changes
need POST, the same origin and the CSRF token (or the bearer header)."""

from __future__ import annotations

import json
import socket
import urllib.request
from http.cookies import SimpleCookie
from pathlib import Path

import pytest

from operator_helpers import free_port, running_daemon

TOKEN = "operator-test-token"

CONFIG = """\
data_dir: {data_dir}
assistant: {{name: Andy, timezone: Europe/Berlin}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
tasks:
  - id: weather
    group: main
    prompt: Send the weather
    cron: "0 8 * * *"
channels:
  http: {{listen: "{listen}"{secret}}}
"""


def request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
            body: dict | None = None) -> tuple[int, dict[str, str], dict | str]:
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    try:
        return status, hdrs, json.loads(raw)
    except ValueError:
        return status, hdrs, raw.decode()


def write_config(tmp_path: Path, listen: str, secret: bool) -> Path:
    extra = ""
    if secret:
        sf = tmp_path / "http.token"
        sf.write_text(TOKEN + "\n")
        sf.chmod(0o600)
        extra = f", secret_file: {sf}"
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG.format(data_dir=tmp_path / "data", listen=listen, secret=extra))
    return cfg


def task_status(cli, cfg: Path) -> str:
    r = cli("tasks", "list", "--json", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    return {t["id"]: t["status"] for t in json.loads(r.stdout)}["weather"]


def test_token_bearer_cookie_login_and_csrf(tmp_path: Path, cli) -> None:
    port = free_port()
    cfg = write_config(tmp_path, f"127.0.0.1:{port}", secret=True)
    base = f"http://127.0.0.1:{port}/operator"
    origin = {"Origin": f"http://127.0.0.1:{port}"}
    with running_daemon(cfg, port):
        # the page itself holds no data: it loads, and asks for the token
        status, hdrs, page = request(f"{base}/")
        assert status == 200 and "Log in" in page
        assert "script-src 'self'" in hdrs["Content-Security-Policy"]
        # no token, a wrong one: 401; the right bearer header: in
        assert request(f"{base}/api/overview")[0] == 401
        assert request(f"{base}/api/overview",
                       headers={"Authorization": "Bearer wrong"})[0] == 401
        status, _, data = request(f"{base}/api/session",
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and data["auth"] == "bearer"
        # the chat's own endpoints keep their bearer rule
        assert request(f"http://127.0.0.1:{port}/groups")[0] == 401

        # login: a wrong token is refused, a login from elsewhere too
        assert request(f"{base}/login", method="POST", headers=origin,
                       body={"token": "nope"})[0] == 401
        assert request(f"{base}/login", method="POST", body={"token": TOKEN})[0] == 403
        status, hdrs, data = request(f"{base}/login", method="POST", headers=origin,
                                     body={"token": TOKEN})
        assert status == 200
        set_cookie = hdrs["Set-Cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        assert "Secure" not in set_cookie  # plain http here; https would add it
        cookie = SimpleCookie(set_cookie)
        session = {"Cookie": f"mdclaw_operator={cookie['mdclaw_operator'].value}"}
        status, _, s = request(f"{base}/api/session", headers=session)
        assert status == 200 and s["auth"] == "cookie" and s["csrf"] == data["csrf"]
        assert request(f"{base}/api/overview", headers=session)[0] == 200

        pause = f"{base}/api/tasks/weather/pause"
        csrf = {"X-CSRF-Token": s["csrf"]}
        # a change needs the CSRF token, the same origin, and POST
        assert request(pause, method="POST", headers={**session, **origin})[0] == 403
        assert request(pause, method="POST", headers={**session, **csrf})[0] == 403
        evil = {"Origin": "http://evil.example"}
        assert request(pause, method="POST", headers={**session, **csrf, **evil})[0] == 403
        assert request(pause, method="POST", headers={
            **session, **csrf, "Referer": "http://evil.example/x"})[0] == 403
        assert request(pause, method="PUT", headers={**session, **csrf, **origin})[0] in (403,
                                                                                       405)
        assert task_status(cli, cfg) == "active"
        status, _, data = request(pause, method="POST", headers={**session, **csrf, **origin})
        assert status == 200, data
        assert task_status(cli, cfg) == "paused"
        # the bearer header stands in for the CSRF token (a browser cannot forge it)
        status, _, _ = request(f"{base}/api/tasks/weather/resume", method="POST",
                               headers={"Authorization": f"Bearer {TOKEN}",
                                        "Referer": f"http://127.0.0.1:{port}/operator/"})
        assert status == 200 and task_status(cli, cfg) == "active"
        # a bulk change is guarded the same way
        bulk = f"{base}/api/bulk/tasks/pause"
        ids = {"ids": ["weather"]}
        assert request(bulk, method="POST", headers={**session, **origin}, body=ids)[0] == 403
        assert request(bulk, method="POST", headers={**session, **csrf, **evil},
                       body=ids)[0] == 403
        assert request(bulk, method="POST", body=ids)[0] == 401
        assert task_status(cli, cfg) == "active"
        assert request(bulk, method="POST", headers={**session, **csrf, **origin},
                       body={"ids": "weather"})[0] == 400
        status, _, data = request(bulk, method="POST", headers={**session, **csrf, **origin},
                                  body=ids)
        assert status == 200 and data == {"done": ["weather"], "refused": {}}, data
        assert task_status(cli, cfg) == "paused"

        # logged out: the cookie opens nothing any more
        assert request(f"{base}/logout", method="POST", headers={**session, **origin})[0] == 200
        assert request(f"{base}/api/overview", headers=session)[0] == 401


def non_loopback_address() -> str | None:
    """An address of this machine that is not loopback (the route's source), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_without_a_token_only_loopback_clients_get_the_page(tmp_path: Path, cli) -> None:
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback address to connect from")
    port = free_port()
    cfg = write_config(tmp_path, f"0.0.0.0:{port}", secret=False)
    with running_daemon(cfg, port):
        status, _, s = request(f"http://127.0.0.1:{port}/operator/api/session")
        assert status == 200 and s["auth"] == "loopback" and s["csrf"]
        # the same machine under another name (DNS rebinding) is refused
        assert request(f"http://127.0.0.1:{port}/operator/api/session",
                       headers={"Host": f"evil.example:{port}"})[0] == 403
        # a client on another address: neither the page nor its data, whatever it claims
        for path in ("/operator/", "/operator/api/overview"):
            status, _, body = request(f"http://{addr}:{port}{path}",
                                      headers={"Host": f"127.0.0.1:{port}",
                                               "X-Forwarded-For": "127.0.0.1"})
            assert status == 403, (path, body)
        # a change from loopback: the page's CSRF token and the same origin
        pause = f"http://127.0.0.1:{port}/operator/api/tasks/weather/pause"
        origin = {"Origin": f"http://127.0.0.1:{port}"}
        assert request(pause, method="POST", headers=origin)[0] == 403
        assert request(pause, method="POST", headers={"X-CSRF-Token": s["csrf"]})[0] == 403
        status, _, _ = request(pause, method="POST",
                               headers={**origin, "X-CSRF-Token": s["csrf"]})
        assert status == 200 and task_status(cli, cfg) == "paused"
        # login makes no sense without a token
        assert request(f"http://127.0.0.1:{port}/operator/login", method="POST",
                       headers=origin, body={"token": "x"})[0] == 400
