"""The local HTTP channel on a real loopback socket, spoken to by a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import pytest

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import ChannelError, InboundMessage
from mdclaw.channels.http import HttpChannel, normalize_jid
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group
from mdclaw.webserver import parse_listen, token_matches
from vm_steps import vm_steps


def make_db(tmp_path: Path) -> Database:
    db = Database(tmp_path / "state.db")
    upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
    upsert_group(db, GroupRow("family", "Family", "hl:family", "@Andy", True, False, "config"))
    upsert_group(db, GroupRow("tele", "Tele", "tg:42", "@Andy", True, False, "config"))
    return db


async def started(db: Database, **kw) -> tuple[HttpChannel, list[InboundMessage]]:
    got: list[InboundMessage] = []
    ch = chat_on_server(db, on_inbound=got.append, **kw)
    await start_chat(ch)
    return ch, got


def test_listen_and_jid_parsing() -> None:
    assert parse_listen("127.0.0.1:3000") == ("127.0.0.1", 3000)
    assert parse_listen(":8080") == ("127.0.0.1", 8080)
    with pytest.raises(ValueError):
        parse_listen("nonsense")
    assert normalize_jid("main") == "hl:main"
    assert normalize_jid("hl:family") == "hl:family"
    for bad in ("tg:1", "hl:", "a b", "hl:../x"):
        with pytest.raises(ValueError):
            normalize_jid(bad)


def test_post_message_reaches_callback_and_reply_is_readable(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, got = await started(db)
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.get("/health") as r:
                    assert r.status == 200
                    assert (await r.json())["status"] == "ok"
                async with http.get("/groups") as r:
                    groups = (await r.json())["groups"]
                    assert [g["jid"] for g in groups] == ["hl:main", "hl:family"]
                # a bare body; no chat named: the main group's hl: chat
                async with http.post("/message", json={"content": "hi there",
                                                       "sender": "u1",
                                                       "sender_name": "Alice"}) as r:
                    assert r.status == 202
                    body = await r.json()
                assert body["jid"] == "hl:main" and body["id"]
                assert len(got) == 1
                m = got[0]
                assert (m.chat_jid, m.sender, m.sender_name, m.content) == (
                    "hl:main", "u1", "Alice", "hi there")
                assert m.id == body["message_id"] and m.id.startswith("hl:main:")
                assert m.timestamp.endswith("Z") and m.channel == "http"
                assert m.chat_name == "Admin" and not m.is_group
                # `channel` picks the chat; `text` is the other spelling
                async with http.post("/message", json={"text": "to family",
                                                       "channel": "family"}) as r:
                    assert r.status == 202
                assert got[1].chat_jid == "hl:family" and got[1].sender == "local"

                cursor = body["seq"]
                # a long poll waits for the reply the assistant sends meanwhile
                async def reply_later() -> None:
                    await asyncio.sleep(0.3)
                    await ch.set_typing("hl:main", True)
                    await asyncio.sleep(0.1)
                    await ch.send_message("hl:main", "hello Alice", reply_to=m.id)

                task = asyncio.create_task(reply_later())
                t0 = time.monotonic()
                async with http.get("/messages", params={"jid": "hl:main", "after": cursor,
                                                         "wait": "10"}) as r:
                    assert r.status == 200
                    data = await r.json()
                await task
                assert time.monotonic() - t0 < 5
                if not data["messages"]:  # the typing change woke the poll first
                    async with http.get("/messages", params={
                            "jid": "hl:main", "after": cursor, "wait": "10",
                            "typing": "1"}) as r:
                        data = await r.json()
                out = [x for x in data["messages"] if x["direction"] == "out"]
                assert [x["content"] for x in out] == ["hello Alice"]
                assert out[0]["sender_name"] == "Andy" and out[0]["reply_to"] == m.id
                assert data["cursor"] == out[-1]["seq"] and data["typing"] is False
                # the whole transcript of the chat, inbound for context
                async with http.get("/messages", params={"jid": "hl:main"}) as r:
                    allm = (await r.json())["messages"]
                assert [(x["direction"], x["content"]) for x in allm] == [
                    ("in", "hi there"), ("out", "hello Alice")]
                # nothing newer: an immediate empty answer keeps the cursor
                async with http.get("/messages", params={"jid": "hl:main",
                                                         "after": data["cursor"]}) as r:
                    empty = await r.json()
                assert empty["messages"] == [] and empty["cursor"] == data["cursor"]
                # files and reactions are shown by name
                f = tmp_path / "report.pdf"
                f.write_bytes(b"%PDF")
                await ch.send_file("hl:family", f, caption="the report")
                await ch.react("hl:family", got[1].id, "\N{THUMBS UP SIGN}")
                async with http.get("/messages", params={"channel": "family"}) as r:
                    fam = (await r.json())["messages"]
                assert [(x["kind"], x["content"], x["file_name"]) for x in fam[1:]] == [
                    ("file", "the report", "report.pdf"), ("reaction", "\N{THUMBS UP SIGN}", None)]
                # the page
                async with http.get("/") as r:
                    assert r.status == 200
                    assert "text/html" in r.headers["Content-Type"]
                    assert "Content-Security-Policy" in r.headers
                    assert "<form" in await r.text()
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_bad_requests_get_400_413(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, got = await started(db, max_body_bytes=4096)
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                cases = [
                    b"{not json", b"[1, 2]", b'"text"', b"{}", b'{"text": ""}',
                    b'{"text": 5}', b'{"text": "x", "jid": "tg:42"}',
                    b'{"text": "x", "channel": "a b"}', b'{"text": "x", "sender": ["a"]}',
                    b'{"text": "x", "sender_name": "' + b"n" * 300 + b'"}',
                    "{\"text\": \"\xff\"}".encode("latin-1"),
                ]
                for raw in cases:
                    async with http.post("/message", data=raw,
                                         headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 400, raw
                        assert "error" in await r.json()
                big = json.dumps({"text": "x" * 10_000}).encode()
                async with http.post("/message", data=big) as r:
                    assert r.status == 413
                # chunked, without Content-Length: still refused at the limit
                async def chunks():
                    for _ in range(10):
                        yield b"x" * 1000

                async with http.post("/message", data=chunks()) as r:
                    assert r.status == 413
                async with http.get("/messages", params={"jid": "hl:main",
                                                         "after": "x"}) as r:
                    assert r.status == 400
                async with http.get("/messages", params={"jid": "tg:42"}) as r:
                    assert r.status == 400
            assert got == []
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_bearer_secret_and_cross_site_requests(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, got = await started(db, secret="s3cret-token")
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                for headers in ({}, {"Authorization": "Bearer wrong"},
                                {"Authorization": "Basic s3cret-token"},
                                {"Authorization": "Bearer s3cret-token-and-more"}):
                    async with http.post("/message", json={"text": "x"},
                                         headers=headers) as r:
                        assert r.status == 401
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                        assert "s3cret" not in await r.text()
                    async with http.get("/messages", params={"jid": "hl:main"},
                                        headers=headers) as r:
                        assert r.status == 401
                    async with http.get("/groups", headers=headers) as r:
                        assert r.status == 401
                async with http.get("/health") as r:
                    assert r.status == 200
                async with http.get("/") as r:
                    assert r.status == 200
                ok = {"Authorization": "Bearer s3cret-token"}
                async with http.post("/message", json={"text": "x"}, headers=ok) as r:
                    assert r.status == 202
                async with http.get("/groups", headers=ok) as r:
                    assert r.status == 200
                # a page on another site cannot post into the chat, token or not
                async with http.post("/message", json={"text": "evil"},
                                     headers={**ok, "Origin": "http://evil.example"}) as r:
                    assert r.status == 403
                # DNS rebinding: a foreign host name on a loopback listener
                async with http.post("/message", json={"text": "evil"},
                                     headers={**ok, "Host": "evil.example"}) as r:
                    assert r.status == 403
                same = f"http://127.0.0.1:{ch.port}"
                async with http.post("/message", json={"text": "page"},
                                     headers={**ok, "Origin": same}) as r:
                    assert r.status == 202
            assert [m.content for m in got] == ["x", "page"]
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_the_page_runs_only_its_own_script_and_style(tmp_path: Path) -> None:
    """The page's CSP allows no inline script or style; its script and style sheet are files
    of their own, served like the page: without the token (they hold no data), with nosniff
    and no-store (an upgrade is never paired with a cached old script)."""
    async def main() -> None:
        db = make_db(tmp_path)
        ch, _ = await started(db, secret="s3cret-token")
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.get("/") as r:
                    assert r.status == 200
                    csp = r.headers["Content-Security-Policy"]
                    page = await r.text()
                directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
                assert directives["script-src"] == "'self'"
                assert directives["style-src"] == "'self'"
                assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
                assert directives["default-src"] == "'none'"
                assert directives["frame-ancestors"] == "'none'"
                assert directives["connect-src"] == "'self'"
                # the page names its files and holds no inline code
                assert '<script src="chat.js"' in page
                assert '<link rel="stylesheet" href="chat.css">' in page
                assert '<link rel="stylesheet" href="mdclaw.css">' in page  # the shared one
                assert "<script>" not in page and "<style" not in page
                assert " style=" not in page and " onclick=" not in page
                for token in ({}, {"Authorization": "Bearer s3cret-token"}):
                    for path, ctype, marker in (("/chat.js", "text/javascript", "use strict"),
                                                ("/chat.css", "text/css", "#log"),
                                                ("/mdclaw.css", "text/css", "--accent")):
                        async with http.get(path, headers=token) as r:
                            assert r.status == 200, path
                            assert r.headers["Content-Type"].startswith(ctype)
                            assert r.headers["X-Content-Type-Options"] == "nosniff"
                            assert r.headers["Cache-Control"] == "no-store"
                            assert marker in await r.text()
                # nothing else is public: an unknown file needs the token like any endpoint
                async with http.get("/other.js") as r:
                    assert r.status == 401
                async with http.get("/other.js",
                                    headers={"Authorization": "Bearer s3cret-token"}) as r:
                    assert r.status == 404
                # a foreign host name on loopback gets nothing, page files included
                async with http.get("/chat.js", headers={"Host": "evil.example"}) as r:
                    assert r.status == 403
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_not_ready_and_failing_host(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch = chat_on_server(db)
        await start_chat(ch)
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.post("/message", json={"text": "early"}) as r:
                    assert r.status == 503

                def broken(msg: InboundMessage) -> None:
                    raise RuntimeError("database is gone")

                ch.on_inbound(broken)
                async with http.post("/message", json={"text": "lost?"}) as r:
                    assert r.status == 500
                    assert "database" not in await r.text()
                async with http.get("/messages", params={"jid": "hl:main"}) as r:
                    assert (await r.json())["messages"] == []  # nothing half-accepted
                async with http.post("/upload", data=upload_form(b"hello")) as r:
                    assert r.status == 500
                    assert "file could not be accepted" in await r.text()
                    assert "database" not in await r.text()
                assert ch.transcript("hl:family") == []  # the upload's row is taken back
        finally:
            await stop_chat(ch)
        assert not ch.is_connected()
        db.close()

    asyncio.run(main())


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        a, _ = await started(db)
        b = chat_on_server(db, listen=f"127.0.0.1:{a.port}")
        try:
            with pytest.raises(OSError) as ei:
                await b.server.start()
            assert f"127.0.0.1:{a.port}" in str(ei.value)
            # the chat cannot answer without its server: it says so, naming the key
            with pytest.raises(ChannelError, match="server.listen"):
                await b.connect()
            assert not b.is_connected()
        finally:
            await stop_chat(a)
            db.close()

    asyncio.run(main())


def test_transcript_keeps_newest_rows(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, _ = await started(db, keep_per_chat=5)
        try:
            for i in range(12):
                await ch.send_message("hl:main", f"m{i}")
            await ch.send_message("hl:family", "other")
            rows = ch.transcript("hl:main")
            assert [r["content"] for r in rows] == [f"m{i}" for i in range(7, 12)]
            assert len(ch.transcript("hl:family")) == 1
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_a_transcript_over_its_limit_is_cut_by_its_next_row_then_kept_at_it(
        tmp_path: Path) -> None:
    """A chat holding more rows than the limit when the channel starts (written under a
    higher one) is cut to its newest rows by the next row written, a taken-back row (the
    host did not take a person's message) leaves no gap in what is kept, and from then on
    each row written drops exactly the oldest."""

    async def main() -> None:
        db = make_db(tmp_path)
        first, _ = await started(db, keep_per_chat=10)
        try:
            for i in range(8):
                await first.send_message("hl:main", f"old{i}")
        finally:
            await stop_chat(first)
        ch, _ = await started(db, keep_per_chat=3)
        try:
            await ch.send_message("hl:main", "m0")
            assert [r["content"] for r in ch.transcript("hl:main")] == ["old6", "old7", "m0"]

            def broken(msg: InboundMessage) -> None:
                raise RuntimeError("no")

            ch.on_inbound(broken)
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.post("/message", json={"text": "taken back"}) as r:
                    assert r.status == 500
            assert [r["content"] for r in ch.transcript("hl:main")] == ["old7", "m0"]
            written = ["old7", "m0"]
            for i in range(1, 5):
                await ch.send_message("hl:main", f"m{i}")
                written.append(f"m{i}")
                assert [r["content"] for r in ch.transcript("hl:main")] == written[-3:]
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_a_reply_costs_the_transcript_the_same_whatever_its_limit(tmp_path: Path) -> None:
    """Writing a row into a chat that holds its limit costs SQLite the same work with a limit
    of 50 rows as with 2,000 (its virtual machine's steps, counted through a progress
    handler): the oldest row goes by a seek of its seq, not a walk of the rows kept."""

    def cost(keep: int) -> int:
        async def main() -> int:
            db = Database(tmp_path / f"s{keep}.db")
            upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True,
                                      "config"))
            ch, _ = await started(db, keep_per_chat=keep)
            try:
                for i in range(keep + 5):
                    await ch.send_message("hl:main", f"m{i}")
                with vm_steps(db.conn, 100) as steps:
                    for i in range(20):
                        await ch.send_message("hl:main", f"r{i}")
                assert len(ch.transcript("hl:main", limit=keep + 100)) == keep
                return steps[0]
            finally:
                await stop_chat(ch)
                db.close()

        return asyncio.run(main())

    small, large = cost(50), cost(2000)
    assert large <= small * 1.2 + 5, (small, large)


def test_the_server_token_is_read_from_its_file_under_either_name(tmp_path: Path) -> None:
    from mdclaw.config import load_config
    from mdclaw.daemon.web import WebServerSetupError, server_gate

    secret = tmp_path / "secret"
    secret.write_text("tok-123\n")
    os.chmod(secret, 0o600)
    for section in (f"server: {{secret_file: {secret}}}\n",
                    f"channels: {{http: {{secret_file: {secret}}}}}\n"):  # the old name
        cfg = load_config(tmp_path / "c.yaml", text=f"data_dir: {tmp_path}\n{section}")
        gate = server_gate(cfg)
        assert gate.has_secret
        assert token_matches(gate._secret, "tok-123") and not token_matches(gate._secret, "x")
    secret.write_text("\n")
    cfg = load_config(tmp_path / "c.yaml", text=f"data_dir: {tmp_path}\nserver: "
                                                 f"{{secret_file: {secret}}}\n")
    with pytest.raises(WebServerSetupError, match="is empty"):
        server_gate(cfg)


def upload_form(data: bytes | object, name: str = "notes.txt", *, jid: str = "hl:family",
                text: str = "", mime: str = "text/plain") -> aiohttp.FormData:
    form = aiohttp.FormData()
    form.add_field("jid", jid)
    form.add_field("sender_name", "Alice")
    form.add_field("text", text)
    form.add_field("file", data, filename=name, content_type=mime)
    return form


def test_uploads_arrive_as_attachments_capped_while_streaming(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, got = await started(db, secret="s3", max_upload_bytes=100_000)
        auth = {"Authorization": "Bearer s3"}
        try:
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.post("/upload", data=upload_form(b"hello")) as r:
                    assert r.status == 401  # the same bearer as posting a message
                async with http.post("/upload", data=upload_form(b"x" * 5000, "cat.png",
                                                                 text="my cat",
                                                                 mime="image/png"),
                                     headers=auth) as r:
                    assert r.status == 202, await r.text()
                    body = await r.json()
                (msg,) = got
                assert (msg.chat_jid, msg.sender_name, msg.content) == (
                    "hl:family", "Alice", "my cat")
                (att,) = msg.attachments
                assert (att.kind, att.name, att.mime, att.size, att.caption) == (
                    "image", "cat.png", "image/png", 5000, "my cat")
                assert await att.fetch(5000) == b"x" * 5000
                with pytest.raises(Exception, match="over the 10 bytes"):
                    await att.fetch(10)
                rows = ch.transcript("hl:family")
                assert [(r["kind"], r["direction"], r["file_name"], r["content"],
                         r["download"]) for r in rows] == [
                    ("file", "in", "cat.png", "my cat", None)]
                assert rows[0]["id"] == body["message_id"]

                # over the limit while streaming (chunked: no Content-Length to go by)
                sent = []

                async def endless():
                    for i in range(1000):
                        sent.append(i)
                        yield b"z" * 10_000

                async with http.post("/upload", data=upload_form(endless(), "big.bin"),
                                     headers=auth) as r:
                    assert r.status == 413
                assert len(sent) < 1000  # the server stopped reading long before the end
                async with http.post("/upload", data=b"not multipart", headers=auth) as r:
                    assert r.status == 400
                form = aiohttp.FormData()
                form.add_field("jid", "hl:family")
                async with http.post("/upload", data=form, headers=auth) as r:
                    assert r.status == 400  # no file
                async with http.post("/upload", data=upload_form(b"x", jid="tg:42"),
                                     headers=auth) as r:
                    assert r.status == 400
            assert len(got) == 1
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


PNG_1PX = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201ffa1f1d4a00000000049454e44ae426082")


def test_files_the_assistant_sends_are_served_only_in_their_chat(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        files = tmp_path / "http-files"
        ch, _got = await started(db, secret="s3", files_dir=files, keep_per_chat=3)
        auth = {"Authorization": "Bearer s3"}
        spool = tmp_path / "spool"
        spool.mkdir()
        (spool / "1-x-pic.png").write_bytes(PNG_1PX)
        (spool / "2-y-page.html").write_bytes(b"<script>alert(1)</script>")
        try:
            img_id = await ch.send_file("hl:family", spool / "1-x-pic.png",
                                        file_name="pic.png", caption="a picture")
            html_id = await ch.send_file("hl:family", spool / "2-y-page.html",
                                         file_name="page.html")
            (spool / "1-x-pic.png").unlink()  # the outbox removes its spool copy
            rows = ch.transcript("hl:family")
            links = [r["download"] for r in rows]
            assert all(links) and [r["id"] for r in rows] == [img_id, html_id]
            async with aiohttp.ClientSession(ch.url) as http:
                async with http.get(links[0]) as r:
                    assert r.status == 401
                async with http.get(links[0], headers=auth) as r:
                    assert r.status == 200 and await r.read() == PNG_1PX
                    assert r.headers["Content-Type"] == "image/png"
                    assert r.headers["Content-Disposition"] == \
                        "inline; filename*=UTF-8''pic.png"
                    assert r.headers["X-Content-Type-Options"] == "nosniff"
                    assert "sandbox" in r.headers["Content-Security-Policy"]
                async with http.get(links[1], headers=auth) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"] == "application/octet-stream"
                    assert r.headers["Content-Disposition"].startswith("attachment;")
                # another chat, a made-up id, a path: nothing
                for params in ({"jid": "hl:main", "id": img_id},
                               {"jid": "hl:family", "id": "hl:family:" + "0" * 32},
                               {"jid": "hl:family", "id": "hl:family:../../state.db"}):
                    async with http.get("/file", params=params, headers=auth) as r:
                        assert r.status == 404, params
            # pruned rows take their files with them
            for i in range(3):
                await ch.send_message("hl:family", f"m{i}")
            assert sorted(p.name for p in files.iterdir()) == []
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_history_before_a_cursor_and_html_of_the_assistants_markdown(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        ch, _ = await started(db)
        try:
            async with aiohttp.ClientSession() as http:
                r = await http.post(f"{ch.url}/message",
                                    json={"jid": "hl:main", "text": "**mine** <b>x</b>"})
                assert r.status == 202
                for i in range(9):
                    await ch.send_message("hl:main", f"**answer {i}** [a](javascript:x)")
                r = await http.get(f"{ch.url}/messages",
                                   params={"jid": "hl:main", "before": "99999", "limit": "4"})
                page = await r.json()
                assert [m["content"][:10] for m in page["messages"]] == [
                    f"**answer {i}"[:10] for i in range(5, 9)]
                assert page["older"] is True and page["cursor"] == page["messages"][-1]["seq"]
                assert page["messages"][0]["html"] == (
                    "<p><strong>answer 5</strong> [a](javascript:x)</p>")
                oldest = page["messages"][0]["seq"]
                r = await http.get(f"{ch.url}/messages",
                                   params={"jid": "hl:main", "before": str(oldest)})
                rest = await r.json()
                assert len(rest["messages"]) == 6 and rest["older"] is False
                mine = rest["messages"][0]
                assert (mine["direction"], mine["html"]) == ("in", None)  # people: text
                assert (await http.get(f"{ch.url}/messages", params={
                    "jid": "hl:main", "before": "x"})).status == 400
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())
