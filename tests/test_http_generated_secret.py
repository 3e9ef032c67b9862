"""server.generate_secret: a token made on first start, required by the web server's local
HTTP chat, read by `mdclaw send` and `mdclaw http-token`; off by default (a laptop's
`mdclaw run` needs none). The server is made as the daemon makes it (mdclaw.daemon.web)."""

from __future__ import annotations

import asyncio
import json
import stat
import urllib.error
import urllib.request
from pathlib import Path

from mdclaw.channels.base import InboundMessage
from mdclaw.channels.registry import build_channels
from mdclaw.config import Config, ensure_http_secret, http_secret_path, load_config
from mdclaw.daemon.web import build_web_server, server_gate
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from test_cli_send import free_port, mdclaw

CONFIG = """\
data_dir: {data_dir}
groups:
  main:
    name: Admin
    jid: "hl:main"
    main: true
server:
  listen: "127.0.0.1:{port}"
{extra}"""


def config(tmp_path: Path, port: int, extra: str = "") -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data_dir=tmp_path / "data", port=port, extra=extra))
    return p


async def serve(cfg: Config, db: Database, inbound):  # noqa: ANN001, ANN201
    """The web server and its chat, as the daemon starts them."""
    server = build_web_server(cfg, server_gate(cfg))
    assert server is not None
    [ch] = build_channels(cfg, db, server, on_inbound=inbound)
    await server.start()
    await ch.connect()
    return server, ch


def post(port: int, token: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/message", headers=headers,
                                 data=json.dumps({"jid": "hl:main", "text": "hi"}).encode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_generated_on_first_start_required_and_used_by_the_cli(tmp_path: Path) -> None:
    port = free_port()
    path = config(tmp_path, port, "  generate_secret: true\n")
    cfg = load_config(path)
    token_file = tmp_path / "data" / "http-secret"
    assert http_secret_path(cfg) == token_file and not token_file.exists()

    async def main() -> None:
        (tmp_path / "data").mkdir()
        db = Database(tmp_path / "data" / "state.db")
        upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
        got: list[InboundMessage] = []

        async def inbound(msg: InboundMessage) -> None:
            got.append(msg)

        server, ch = await serve(cfg, db, inbound)
        try:
            assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
            token = token_file.read_text().strip()
            assert len(token) >= 40
            # another local user, without the token, cannot post as the main group
            assert await asyncio.to_thread(post, port, None) == 401
            assert await asyncio.to_thread(post, port, "guess") == 401
            assert await asyncio.to_thread(post, port, token) == 202
            code, out, err = await mdclaw("send", "-c", str(path), "-g", "main", "from cli")
            assert code == 0, err
            assert [m.content for m in got] == ["hi", "from cli"]
            code, out, err = await mdclaw("http-token", "-c", str(path))
            assert code == 0 and out.strip() == token
        finally:
            await ch.disconnect()
            await server.stop()
            db.close()
        # a second start keeps the token: pages and scripts that saved it keep working
        assert ensure_http_secret(cfg) == token_file
        assert token_file.read_text().strip() == token

    asyncio.run(main())


def test_before_first_start_the_cli_says_so(tmp_path: Path) -> None:
    path = config(tmp_path, free_port(), "  generate_secret: true\n")
    code, out, err = asyncio.run(mdclaw("http-token", "-c", str(path)))
    assert code == 1 and "does not exist yet" in err and "first starts" in err


def test_a_configured_secret_file_wins(tmp_path: Path) -> None:
    secret = tmp_path / "mine"
    secret.write_text("configured")
    secret.chmod(0o600)
    path = config(tmp_path, free_port(),
                  f"  generate_secret: true\n  secret_file: {secret}\n")
    cfg = load_config(path)
    assert http_secret_path(cfg) == secret and ensure_http_secret(cfg) == secret
    assert not (tmp_path / "data" / "http-secret").exists()


def test_off_by_default_nothing_is_generated(tmp_path: Path) -> None:
    port = free_port()
    cfg = load_config(config(tmp_path, port))
    assert cfg.web_server is not None and cfg.web_server.generate_secret is False
    assert http_secret_path(cfg) is None and ensure_http_secret(cfg) is None

    async def main() -> None:
        (tmp_path / "data").mkdir()
        db = Database(tmp_path / "data" / "state.db")
        upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
        async def inbound(msg: InboundMessage) -> None:
            pass

        server, ch = await serve(cfg, db, inbound)
        try:
            assert await asyncio.to_thread(post, port, None) == 202
        finally:
            await ch.disconnect()
            await server.stop()
            db.close()
        assert not (tmp_path / "data" / "http-secret").exists()

    asyncio.run(main())
