"""WhatsApp enabled on an install without neonize (the Nix package has none): the channel
does not start, says why with the fix, and the daemon's other channels run."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from mdclaw.channels.registry import build_channels, connect_all, disconnect_all
from mdclaw.config import load_config
from mdclaw.daemon.web import build_web_server, server_gate
from mdclaw.state import Database


def test_whatsapp_without_neonize_does_not_stop_the_other_channels(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "neonize" or m.startswith("neonize.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "neonize", None)  # `import neonize...` now fails
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "groups: {main: {name: Main, jid: 'hl:main', main: true}}\n"
        "server: {listen: '127.0.0.1:0'}\n"
        "channels: {http: {enabled: true}, whatsapp: {enabled: true}}\n")
    cfg = load_config(cfg_file)
    db = Database(tmp_path / "s.db")

    async def main() -> dict[str, str]:
        server = build_web_server(cfg, server_gate(cfg))
        assert server is not None
        chans = build_channels(cfg, db, server)  # builds: nothing raised at start-up
        await server.start()
        try:
            problems = await connect_all(chans)
            assert {c.name: c.is_connected() for c in chans} == {"http": True,
                                                                 "whatsapp": False}
            return problems
        finally:
            await disconnect_all(chans)
            await server.stop()

    try:
        problems = asyncio.run(main())
    finally:
        db.close()
    assert list(problems) == ["whatsapp"]
    assert "needs neonize" in problems["whatsapp"]
    assert "mdclaw[whatsapp]" in problems["whatsapp"]
