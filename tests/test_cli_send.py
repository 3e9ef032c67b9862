"""`mdclaw send` in a subprocess against a real local HTTP channel on loopback."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path

from http_helpers import chat_on_server, start_chat, stop_chat
from mdclaw.channels.base import InboundMessage
from mdclaw.channels.http import HttpChannel
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, upsert_group

REPO = Path(__file__).resolve().parent.parent

CONFIG = """\
data_dir: {data_dir}
groups:
  main:
    name: Admin
    jid: "hl:main"
    main: true
  tele:
    name: Tele
    jid: "tg:42"
channels:
  http:
    listen: "127.0.0.1:{port}"
{extra}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp_path: Path, port: int, secret: str | None = None) -> Path:
    extra = ""
    if secret:
        f = tmp_path / "http-secret"
        f.write_text(secret)
        os.chmod(f, 0o600)
        extra = f"    secret_file: {f}\n"
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data_dir=tmp_path / "data", port=port, extra=extra))
    return p


async def mdclaw(*args: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mdclaw", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


def test_send_reaches_the_daemon_and_prints_the_reply(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = write_config(tmp_path, free_port(), secret="cli-secret-1")
        port = int(cfg.read_text().split("127.0.0.1:")[1].split('"')[0])
        db = Database(tmp_path / "state.db")
        upsert_group(db, GroupRow("main", "Admin", "hl:main", "@Andy", False, True, "config"))
        got: list[InboundMessage] = []
        ch: HttpChannel

        async def answer(msg: InboundMessage) -> None:
            got.append(msg)

            async def later() -> None:
                await asyncio.sleep(0.2)
                await ch.send_message(msg.chat_jid, f"you said: {msg.content}")

            asyncio.get_running_loop().create_task(later())

        ch = chat_on_server(db, listen=f"127.0.0.1:{port}", secret="cli-secret-1",
                            on_inbound=answer)
        await start_chat(ch)
        try:
            code, out, err = await mdclaw("send", "-c", str(cfg), "--group", "main",
                                          "--sender", "tester", "--wait", "10", "hello", "bot")
            assert code == 0, err
            assert "sent to hl:main" in out
            assert "Andy: you said: hello bot" in out
            assert [(m.sender, m.content) for m in got] == [("tester", "hello bot")]
            # a group that does not answer in the local channel
            code, out, err = await mdclaw("send", "-c", str(cfg), "-g", "tele", "x")
            assert code == 1 and "tg:42" in err and "hl:" in err
            code, out, err = await mdclaw("send", "-c", str(cfg), "-g", "nope", "x")
            assert code == 1 and "no group 'nope'" in err
        finally:
            await stop_chat(ch)
            db.close()
        # a wrong token is refused, and says which file to check
        cfg2 = write_config(tmp_path, port, secret="other")
        ch2 = chat_on_server(Database(tmp_path / "state2.db"), listen=f"127.0.0.1:{port}",
                             secret="cli-secret-1", on_inbound=got.append)
        await start_chat(ch2)
        try:
            code, out, err = await mdclaw("send", "-c", str(cfg2), "-g", "main", "x")
            assert code == 1 and "secret_file" in err and "other" not in err
        finally:
            await stop_chat(ch2)

    asyncio.run(main())


def test_send_says_clearly_when_the_daemon_is_not_running(tmp_path: Path) -> None:
    async def main() -> None:
        port = free_port()
        cfg = write_config(tmp_path, port)
        code, out, err = await mdclaw("send", "-c", str(cfg), "-g", "main", "hello")
        assert code == 1
        assert "not running" in err and f"127.0.0.1:{port}" in err and "mdclaw run" in err

    asyncio.run(main())
