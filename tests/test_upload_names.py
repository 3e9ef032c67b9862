"""Hostile file names on the local HTTP chat's `POST /upload`, as raw multipart bodies built
byte by byte and sent over a real socket to the real server: every name is either taken as
safe UTF-8 text (202) or refused with a 400 that says what to send instead; never a 500."""

from __future__ import annotations

import asyncio
import json
import random
import unicodedata
from pathlib import Path

import pytest

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import InboundMessage
from mdclaw.channels.http import HttpChannel, upload_file_name, upload_mime
from mdclaw.media import safe_name
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group

BOUNDARY = b"b0undary7MA4YWxk"


def multipart(disposition: bytes, *, content_type: bytes = b"text/plain",
              fields: tuple[tuple[bytes, bytes], ...] = ((b"jid", b"hl:family"),)) -> bytes:
    out = b""
    for name, value in fields:
        out += (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"" + name
                + b"\"\r\n\r\n" + value + b"\r\n")
    out += (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"; "
            + disposition + b"\r\nContent-Type: " + content_type + b"\r\n\r\nhello\r\n")
    return out + b"--" + BOUNDARY + b"--\r\n"


async def post(port: int, body: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                 b"Content-Type: multipart/form-data; boundary=" + BOUNDARY + b"\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    raw = await reader.read()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, {"raw": payload[:300].decode("latin-1")}


def make_db(tmp_path: Path) -> Database:
    db = Database(tmp_path / "state.db")
    upsert_group(db, GroupRow("family", "Family", "hl:family", "@Andy", True, False, "config"))
    return db


def check_safe(name: str | None) -> None:
    """A name the host can store, show and save: UTF-8, no control or format characters,
    no path, at most 200 characters."""
    if name is None:
        return
    name.encode("utf-8")  # no surrogates left
    assert not any(unicodedata.category(c)[0] == "C" for c in name), name
    assert "/" not in name and "\\" not in name and len(name) <= 200
    saved = safe_name(name)
    assert saved and "/" not in saved and not saved.startswith(".")


# (Content-Disposition after `name="file"; `, what the host should get: a name, None for no
# name, or 400 with words the answer must contain)
CASES: list[tuple[bytes, object]] = [
    (b'filename="a\xff\xfe.txt"', "a\ufffd\ufffd.txt"),            # not UTF-8
    (b'filename="\xc3(\xa0\xa1.pdf"', "\ufffd(\ufffd\ufffd.pdf"),  # bad continuation bytes
    (b'filename="caf\xc3\xa9.txt"', "caf\u00e9.txt"),               # UTF-8 as it is
    (b'filename="cafe\xcc\x81.txt"', "caf\u00e9.txt"),              # NFC
    (b'filename="\xe2\x80\xaetxt.exe"', "_txt.exe"),                # RTL override
    (b'filename="a\xe2\x80\x8bb.txt"', "a_b.txt"),                  # zero-width space
    (b'filename="../../etc/passwd"', "passwd"),
    (b'filename="..\\\\..\\\\boot.ini"', "boot.ini"),
    (b'filename="/"', None),
    (b'filename=""', None),
    (b'filename="   "', None),
    (b'filename="a\\"b.txt"', 'a"b.txt'),
    (b'filename="' + b"n" * 5000 + b'.txt"', "n" * 200),               # long: cut
    (b"filename*=UTF-8''%E2%82%AC%20rates.txt", "\u20ac rates.txt"),  # RFC 5987
    (b"filename*=iso-8859-1''%A3%20rates.txt", "\u00a3 rates.txt"),
    (b"filename*=UTF-8''a%00b%0Dc%1B.txt", "a_b_c_.txt"),          # NUL, CR, ESC encoded
    (b"filename*=UTF-8''..%2F..%2Fx.txt", "x.txt"),
    (b"filename*=UTF-8''%E2%80%AEgpj.exe", "_gpj.exe"),
    (b"filename*=UTF-8''" + b"%E2%82%AC" * 900, "\u20ac" * 200),
    (b'filename="old.txt"; filename*=UTF-8\'\'new.txt', "new.txt"),
    # refused, with the fix
    (b'filename="a\x00b.txt"', (400, "percent-encoded")),             # NUL in the header
    (b'filename="a\x01\x1bb.txt"', (400, "percent-encoded")),
    (b'filename="a\rb.txt"', (400, "percent-encoded")),
    (b'filename="' + b"a" * 10_000 + b'"', (400, "under 8 KB")),       # 10 KB: over a line
    (b"filename*=UTF-8''%FF%FE.txt", (400, "filename*=UTF-8")),      # not UTF-8 once decoded
    (b"filename*=UTF-8''%ZZ%", "%ZZ%"),                             # not an escape: text
]


@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionParam",
                            "ignore::aiohttp.BadContentDispositionHeader")
def test_hostile_upload_names_are_safe_text_or_a_clear_400(tmp_path: Path) -> None:
    async def main() -> None:
        db = make_db(tmp_path)
        got: list[InboundMessage] = []
        ch = chat_on_server(db, on_inbound=got.append)
        await start_chat(ch)
        try:
            for disposition, want in CASES:
                before = len(got)
                status, body = await post(ch.port, multipart(disposition))
                if isinstance(want, tuple):
                    assert (status, want[1] in body.get("error", "")) == (want[0], True), (
                        disposition[:60], status, body)
                    assert len(got) == before
                    continue
                assert status == 202, (disposition[:60], status, body)
                (att,) = got[-1].attachments
                assert att.name == want, (disposition[:60], att.name)
                check_safe(att.name)
                row = ch.transcript("hl:family")[-1]
                assert row["id"] == body["message_id"] and row["file_name"] == (want or None)
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


@pytest.mark.filterwarnings("ignore::aiohttp.BadContentDispositionParam",
                            "ignore::aiohttp.BadContentDispositionHeader")
def test_random_bytes_in_every_header_never_answer_500(tmp_path: Path) -> None:
    """Seeded random bytes as the quoted name, the RFC 5987 name, the part's type and the
    text fields: 202 with a safe name, or 400."""
    rnd = random.Random(27)

    def junk(n: int) -> bytes:
        return bytes(rnd.choice(b'\x00\x01\r\n\t"\\/;=%\x7f\x80\xff\xc3\xe2\xa0 aZ.')
                     for _ in range(rnd.randint(0, n)))

    async def main() -> None:
        db = make_db(tmp_path)
        got: list[InboundMessage] = []
        ch = chat_on_server(db, on_inbound=got.append)
        await start_chat(ch)
        statuses: dict[int, int] = {}
        reasons: set[str] = set()
        try:
            for i in range(300):
                which = i % 4
                disposition = (b'filename="' + junk(40) + b'"' if which == 0 else
                               b"filename*=UTF-8''" + junk(40) if which == 1 else
                               b'filename="x.bin"')
                ctype = junk(30) if which == 2 else b"application/octet-stream"
                fields = ((b"jid", b"hl:family"),
                          (b"sender_name", junk(30)), (b"text", junk(60)),
                          (junk(10), junk(10))) if which == 3 else ((b"jid", b"hl:family"),)
                status, body = await post(ch.port, multipart(disposition, content_type=ctype,
                                                             fields=fields))
                statuses[status] = statuses.get(status, 0) + 1
                assert status in (202, 400), (disposition, ctype, fields, status, body)
                if status == 400:
                    reasons.add(body["error"].split(" (", 1)[0].split(":", 1)[0])
                if status == 202:
                    (att,) = got[-1].attachments
                    check_safe(att.name)
                    assert att.mime is None or upload_mime(att.mime) == att.mime
                    assert isinstance(got[-1].content, str)
                    got[-1].content.encode("utf-8")
                    got[-1].sender_name.encode("utf-8")
            # taken, or refused for a reason the answer names (a header aiohttp refuses
            # as HTTP, a filename* it cannot decode, a field too long, no file part: a
            # newline in a header ends the part's head early)
            assert statuses.get(202, 0) > 30, statuses
            assert reasons <= {"malformed multipart body", "the file's name cannot be read",
                               "field 'sender_name' must be at most 200 characters",
                               "field 'file'"}, reasons
        finally:
            await stop_chat(ch)
            db.close()

    asyncio.run(main())


def test_the_name_rules() -> None:
    assert upload_file_name("report.pdf") == "report.pdf"
    assert upload_file_name("a\udcff.txt") == "a\ufffd.txt"  # aiohttp's undecodable byte
    assert upload_file_name("C:\\Users\\me\\x.doc") == "x.doc"
    assert upload_file_name("\x00") == "_"
    assert upload_mime("image/PNG; charset=x") == "image/png"
    for bad in ("", "image", "a/b/c", "image/png\x00", "im\udcffage/png", "/png"):
        assert upload_mime(bad) is None
    assert HttpChannel.max_message_length > 0
