"""`mdclaw send`: write into a group's chat through the running daemon's local HTTP channel;
`mdclaw http-token`: the daemon's web server's token (for the chat page and the operator
page)."""

from __future__ import annotations

import argparse
import getpass
import json
import sqlite3
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from mdclaw.commands.output import print_json
from mdclaw.config import Config, http_secret_path, read_secret
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.state import Database, DatabaseError
from mdclaw.state.groups import get_group


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("send", parents=[common],
                       help="send a message to a group through the running daemon's local "
                            "HTTP channel")
    p.add_argument("--group", "-g", required=True, metavar="FOLDER",
                   help="the group (its folder name) whose hl: chat gets the message")
    p.add_argument("--sender", metavar="NAME", default=None,
                   help="sender name shown to the assistant (default: your user name)")
    p.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                   help="wait this long for the assistant's reply and print it")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("text", nargs="+", help="the message")
    p.set_defaults(func=cmd_send)
    p = sub.add_parser("http-token", parents=[common],
                       help="print the local HTTP channel's token (to paste into the chat page)")
    p.set_defaults(func=cmd_http_token)


def _group_jid(cfg: Config, folder: str) -> str:
    group = cfg.groups.get(folder)
    jid = group.jid if group is not None else _registered_jid(cfg, folder)
    if jid is None:
        known = ", ".join(sorted(cfg.groups)) or "none configured"
        fail(f"no group {folder!r} (groups: {known})")
    if not jid.startswith("hl:"):
        fail(f"group {folder!r} answers in {jid}, not in the local HTTP channel; "
             "`mdclaw send` can only write to hl: chats (give the group a jid like "
             f"\"hl:{folder}\")")
    return jid


def _registered_jid(cfg: Config, folder: str) -> str | None:
    """A group registered at run time (by the main group's agent) lives only in state.db."""
    if not cfg.db_path.exists():
        return None
    try:
        with Database(cfg.db_path, migrate=False) as db:
            g = get_group(db, folder)
    except (DatabaseError, OSError, sqlite3.Error):  # unreadable now: as if not registered
        return None
    return g.jid if g else None


def _base_url(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):  # noqa: S104 - a comparison, nothing binds
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def _request(url: str, token: str | None, listen: str, data: bytes | None = None,
             timeout: float = 10) -> dict[str, Any]:
    headers = {"Accept": "application/json"}
    if data is not None:
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    # `url` is the local HTTP channel's own http:// address, built above (S310: no file://).
    req = urllib.request.Request(url, data=data, headers=headers,  # noqa: S310
                                 method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            reason = ""
        if e.code == 401:
            fail("the daemon refused the token: check server.secret_file")
        fail(f"the daemon answered {e.code}{': ' + reason if reason else ''}")
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        why = getattr(e, "reason", e)
        fail(f"the daemon is not running or not reachable: nothing answers on {listen} "
             f"(server.listen; {why}); start it with `mdclaw run`")


def _token(cfg: Config) -> str | None:
    """The web server's token (server.secret_file, or the generated one), or None."""
    path = http_secret_path(cfg)
    server = cfg.web_server
    if path is None or server is None:
        return None
    key = ("server.secret_file" if server.secret_file is not None
           else "the generated token (server.generate_secret)")
    try:
        return read_secret(path)
    except FileNotFoundError:
        fail(f"{key} {path} does not exist yet: the daemon writes it when it first starts")
    except PermissionError:
        fail(f"cannot read {key} {path}: only the service's user can; run the command as "
             "root (`sudo mdclaw ...`)")
    except OSError as e:
        fail(f"cannot read {key} {path}: {e.strerror or e}")


def cmd_http_token(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    if cfg.web_server is None:
        fail("the daemon has no web server (server: null)")
    token = _token(cfg)
    if token is None:
        fail("the web server has no token: set server.secret_file or server.generate_secret")
    print(token)
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    http, server = cfg.channels.http, cfg.web_server
    if http is None or not http.enabled or server is None:
        fail("the local HTTP channel is disabled (channels.http); `mdclaw send` needs it")
    listen = server.listen
    jid = _group_jid(cfg, args.group)
    token = _token(cfg)
    base = _base_url(listen)
    sender = args.sender or getpass.getuser()
    body = json.dumps({"text": " ".join(args.text), "jid": jid, "sender": sender,
                       "sender_name": sender}).encode()
    accepted = _request(f"{base}/message", token, listen, body)
    replies: list[dict[str, Any]] = []
    if args.wait > 0:
        cursor = int(accepted.get("seq", 0))
        deadline = time.monotonic() + args.wait
        while not replies and (left := deadline - time.monotonic()) > 0:
            q = urllib.parse.urlencode({"jid": jid, "after": cursor,
                                        "wait": f"{min(left, 25):.1f}"})
            page = _request(f"{base}/messages?{q}", token, listen, timeout=left + 10)
            cursor = int(page.get("cursor", cursor))
            replies = [m for m in page.get("messages", []) if m.get("direction") == "out"]
    if args.json:
        print_json({**accepted, "replies": replies})
    else:
        print(f"sent to {jid} (request {accepted.get('id', '?')})")
        for m in replies:
            text = m.get("content", "")
            if m.get("kind") == "file":
                text = f"[file {m.get('file_name')}] {text}".rstrip()
            elif m.get("kind") == "reaction":
                text = f"[reaction {text}]"
            print(f"{m.get('sender_name') or 'assistant'}: {text}")
    if args.wait > 0 and not replies:
        print(f"mdclaw: no reply within {args.wait:g} s", file=sys.stderr)
        return 1
    return 0
