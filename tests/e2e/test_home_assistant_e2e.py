"""Home Assistant from the real agent image on the real engine: a scripted model turns a
light on with the ha_set_entity tool; the host's IPC engine and action worker call the fake
Home Assistant (the container has no network and never sees the token), the fake records
the service call, and the tool's answer reaches the model. A call outside the allow-list is
refused with the rule, and a non-main group's container gets no Home Assistant tools."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from mdclaw.config import load_config
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.paths import Layout
from mdclaw.proxy import CredentialProxy
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import install_labels
from mdclaw.state import Database

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fake_home_assistant import FakeHomeAssistant  # noqa: E402
from fake_models import FakeOpenAI, call, say  # noqa: E402

pytestmark = pytest.mark.e2e

TOKEN = "ha-e2e-token-5b1d0c-SECRET"


def test_model_turns_a_light_on(tmp_path, engine, real_agent_image, install_id, reap) -> None:
    model = FakeOpenAI([
        call("ha_set_entity", entity_id="light.kitchen", state="on"),
        call("ha_call_service", domain="switch", service="turn_off",
             target={"entity_id": "switch.pump"}),
        say("the kitchen light is on"),
        # the family group's run
        say("no home tools here"),
    ]).start()
    token_file = tmp_path / "ha-token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    fake = FakeHomeAssistant(TOKEN)

    async def scenario():  # noqa: ANN202
        ha_server = TestServer(fake.app(), host="127.0.0.1")
        await ha_server.start_server()
        cfg_path = tmp_path / "config.yaml"
        cfg_path.write_text(textwrap.dedent(f"""\
            data_dir: {tmp_path / 'data'}
            assistant: {{name: Andy, timezone: UTC, model: local}}
            models:
              local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}
            groups:
              main: {{name: Admin, jid: "tg:1", main: true}}
              family: {{name: Family, jid: "tg:2"}}
            integrations:
              home_assistant:
                url: "{str(ha_server.make_url('')).rstrip('/')}"
                token_file: {token_file}
                allow: {{services: ["light.*"], entities: ["light.*", "switch.pump"]}}
            limits: {{container_timeout: 120s, idle_timeout: 60s, memory: 256m, cpus: 1.0,
                      pids: 128}}
            runtime: {{image: {real_agent_image}, install_id: {install_id}}}
            """))
        cfg = load_config(cfg_path)
        reap(install_labels(cfg))
        db = Database(cfg.db_path)
        reconcile(cfg, db)
        watcher = IpcWatcher(cfg, db)
        stop = asyncio.Event()
        serving = asyncio.create_task(watcher.run(stop))
        runner = ContainerRunner(cfg, engine)
        proxy = CredentialProxy(Layout(cfg.data_dir))
        outs: dict[str, list[dict]] = {"main": [], "family": []}
        results = {}
        try:
            for folder, jid in (("main", "tg:1"), ("family", "tg:2")):
                async with proxy.for_run(cfg, folder) as fields:
                    results[folder] = await runner.run(
                        folder, ContainerInput(prompt="turn the kitchen light on",
                                               group_folder=folder, chat_jid=jid,
                                               is_scheduled_task=True, **fields),
                        on_output=lambda b, f=folder: outs[f].append(json.loads(b)))
        finally:
            stop.set()
            await serving
            watcher.close()
            await proxy.close()
            await runner.aclose()
            await ha_server.close()
            db.close()
        return cfg, results, outs

    cfg, results, outs = asyncio.run(scenario())
    model.stop()
    res = results["main"]
    assert res.exit_code == 0 and res.status == "success", res.stderr_tail
    assert outs["main"][0]["result"] == "the kitchen light is on"
    # The fake Home Assistant got the call, with the token, from the host.
    assert ("light", "turn_on", {"entity_id": "light.kitchen"}) in fake.calls
    assert fake.states["light.kitchen"]["state"] == "on"
    replies = model.tool_results()
    assert '"service": "light.turn_on"' in replies[0], replies
    assert "service switch.turn_off is not in integrations.home_assistant.allow.services " \
           "[light.*]" in replies[1], replies
    assert [c for c in fake.calls if c[0] == "switch"] == []
    # The non-main group's model was offered no Home Assistant tool.
    family_request = [q for q in model.requests if q.path == "/v1/chat/completions"][-1]
    offered = {t["function"]["name"] for t in family_request.body.get("tools", [])}
    assert "send_message" in offered and not [n for n in offered if n.startswith("ha_")]
    main_request = [q for q in model.requests if q.path == "/v1/chat/completions"][0]
    assert "ha_set_entity" in {t["function"]["name"] for t in main_request.body["tools"]}
    # The token is nowhere under data_dir (ipc/, results, the database) nor in the
    # container's output.
    for p in cfg.data_dir.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert TOKEN.encode() not in p.read_bytes(), p
    assert TOKEN not in (res.stderr_tail or "")
