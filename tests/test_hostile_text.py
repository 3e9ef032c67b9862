"""Bytes that are not text where the daemon's web server reads text, from a raw socket
against a real daemon: a bearer token, a session cookie or a CSRF token that is not UTF-8,
JSON that spells a lone surrogate (`\\ud800`). Each is refused (400, 401, 403), never a 500
and never a traceback in the log."""

from __future__ import annotations

import json
import re
import socket
from http.cookies import SimpleCookie
from pathlib import Path

from operator_helpers import free_port, running_daemon
from test_operator_access import request, write_config

TOKEN = "operator-test-token"  # test_operator_access's


def raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + b"Host: 127.0.0.1:%d\r\nConnection: close\r\nContent-Length: %d"
                  b"\r\n\r\n" % (port, len(body)) + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    m = re.match(rb"HTTP/1\.1 (\d{3})", out)
    assert m, out[:200]
    return int(m.group(1)), out.partition(b"\r\n\r\n")[2]


def test_text_that_is_not_text_is_refused_not_a_500(tmp_path: Path) -> None:
    port = free_port()
    cfg = write_config(tmp_path, f"127.0.0.1:{port}", secret=True)
    bearer = f"Authorization: Bearer {TOKEN}\r\n".encode()
    origin = f"Origin: http://127.0.0.1:{port}\r\n".encode()
    with running_daemon(cfg, port):
        # A session, so that a cookie is compared with one.
        status, hdrs, data = request(f"http://127.0.0.1:{port}/operator/login", method="POST",
                                     headers={"Origin": f"http://127.0.0.1:{port}"},
                                     body={"token": TOKEN})
        assert status == 200
        sid = SimpleCookie(hdrs["Set-Cookie"])["mdclaw_operator"].value
        cookie = f"Cookie: mdclaw_operator={sid}\r\n".encode()
        got = {
            "chat, bearer \\xff\\xfe": raw(port, b"GET /groups HTTP/1.1\r\n"
                                           b"Authorization: Bearer \xff\xfe\r\n"),
            "operator, bearer \\xc3": raw(port, b"GET /operator/api/overview HTTP/1.1\r\n"
                                         b"Authorization: Bearer \xc3\r\n"),
            "operator, cookie \\xff": raw(port, b"GET /operator/api/overview HTTP/1.1\r\n"
                                         b"Cookie: mdclaw_operator=\xff\xfe\r\n"),
            "operator, CSRF \\xff": raw(
                port, b"POST /operator/api/tasks/weather/pause HTTP/1.1\r\n" + cookie + origin
                + b"X-CSRF-Token: \xff" + data["csrf"].encode() + b"\r\n"),
            "login, token \\ud800": raw(port, b"POST /operator/login HTTP/1.1\r\n" + origin
                                        + b"Content-Type: application/json\r\n",
                                        b'{"token": "\\ud800"}'),
            "message, text \\ud800": raw(port, b"POST /message HTTP/1.1\r\n" + bearer
                                         + b"Content-Type: application/json\r\n",
                                         b'{"jid": "hl:main", "text": "hi \\ud800"}'),
            "message, sender \\udcff": raw(port, b"POST /message HTTP/1.1\r\n" + bearer
                                           + b"Content-Type: application/json\r\n",
                                           b'{"jid": "hl:main", "text": "hi", '
                                           b'"sender": "\\udcff"}'),
        }
        # The right credentials still open the doors after all that.
        ok = raw(port, b"GET /operator/api/overview HTTP/1.1\r\n" + cookie)[0]
        # (the CSRF case is refused for its token alone: with the right one it goes)
        paused = raw(port, b"POST /operator/api/tasks/weather/pause HTTP/1.1\r\n" + cookie
                     + origin + b"X-CSRF-Token: " + data["csrf"].encode() + b"\r\n")[0]
        said = raw(port, b"POST /message HTTP/1.1\r\n" + bearer
                   + b"Content-Type: application/json\r\n",
                   b'{"jid": "hl:main", "text": "hi \\ud83d\\ude00"}')[0]  # a real pair
    statuses = {k: v[0] for k, v in got.items()}
    assert statuses == {
        "chat, bearer \\xff\\xfe": 401, "operator, bearer \\xc3": 401,
        "operator, cookie \\xff": 401, "operator, CSRF \\xff": 403,
        "login, token \\ud800": 401, "message, text \\ud800": 400,
        "message, sender \\udcff": 400}
    assert "lone surrogate" in json.loads(got["message, text \\ud800"][1])["error"]
    assert (ok, said, paused) == (200, 202, 200)
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()
