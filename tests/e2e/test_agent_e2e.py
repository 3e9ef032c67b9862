"""The real agent image on a real engine, with the openai backend and a scripted fake model
server on the host's loopback, reached only through the credential proxy's unix socket.

The image is built offline from container/Dockerfile on the debootstrap test base with a
wheelhouse made by container/build-wheelhouse.sh. The host side is the real thing: the
container runner, the credential proxy, the reconciler and the IPC engine (through the CLI).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import docker
import pytest

from mdclaw.config import load_config
from mdclaw.ipc.writers import write_close, write_follow_up
from mdclaw.models import container_model_fields
from mdclaw.paths import Layout
from mdclaw.proxy import CredentialProxy
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import install_labels
from mdclaw.state import Database

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_images import build_agent_image  # noqa: E402

from fake_models import FakeOpenAI, call, say  # noqa: E402
from waiting import wait_until_async  # noqa: E402

pytestmark = pytest.mark.e2e

BASE_IMAGE = os.environ.get("MDCLAW_TEST_BASE_IMAGE", "mdclaw-test-base")
REAL_KEY = "sk-e2e-REAL-9f3c1a7b"


def cli(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mdclaw", *args, "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=120)


# Run inside the container: look for the key (given in two halves, so this process's own
# command line does not hold it) in every process's environment and command line and in
# every file under the writable and configuration folders.
SCAN_FOR_KEY = """
import os, sys
key = (sys.argv[1] + sys.argv[2]).encode()
placeholder = b'ANTHROPIC_API_KEY=mdclaw-placeholder-key'
hits, n, with_placeholder = [], 0, 0
for pid in filter(str.isdigit, os.listdir('/proc')):
    for what in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{pid}/{what}', 'rb').read()
        except OSError:
            continue
        n += 1
        with_placeholder += placeholder in data
        if key in data:
            hits.append(f'/proc/{pid}/{what}')
for top in ('/workspace', '/home', '/tmp', '/opt', '/etc'):
    for root, dirs, files in os.walk(top):
        for f in files:
            p = os.path.join(root, f)
            try:
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                n += 1
                if key in open(p, 'rb').read():
                    hits.append(p)
            except OSError:
                pass
print('scanned', n, 'placeholder', with_placeholder, *(['FOUND'] + hits if hits else []))
"""


def container_exec(engine, name: str, cmd: list[str]) -> tuple[int, str]:
    client = docker.DockerClient(base_url=engine.base_url)
    res = client.containers.get(name).exec_run(cmd, user="1000")
    return res.exit_code, res.output.decode("utf-8", "replace")


def test_openai_agent_end_to_end(tmp_path, engine, real_agent_image, install_id, reap) -> None:
    key_file = tmp_path / "model.key"
    key_file.write_text(REAL_KEY + "\n")
    key_file.chmod(0o600)
    server = FakeOpenAI([
        call("send_message", text="Hello from the container"),
        call("schedule_task", prompt="water the plants", schedule_type="cron",
             schedule_value="0 8 * * *", task_id="water-plants"),
        say("first turn done"),
        say("second turn done"),
    ]).start()
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{server.url}/v1",
                   api_key_file: {key_file}}}
        groups:
          main: {{name: Admin, jid: "tg:1", main: true}}
          family: {{name: Family, jid: "tg:2"}}
        limits: {{container_timeout: 120s, idle_timeout: 60s, memory: 256m, cpus: 1.0, pids: 128}}
        runtime: {{image: {real_agent_image}, install_id: {install_id}}}
        """))
    r = cli("reconcile", config=cfg_path)
    assert r.returncode == 0, r.stderr
    cfg = load_config(cfg_path)
    reap(install_labels(cfg))
    layout = Layout(cfg.data_dir)

    async def scenario() -> dict:
        db = Database(cfg.db_path)
        proxy = CredentialProxy(layout, db)
        runner = ContainerRunner(cfg, engine)
        outputs: list[dict] = []
        names: list[str] = []
        try:
            await proxy.start_for_config(cfg, "family")
            fields = container_model_fields(cfg, "family")
            inp = ContainerInput(prompt="please greet and schedule watering",
                                 group_folder="family", chat_jid="tg:2",
                                 assistant_name="Andy", **fields)
            run = asyncio.create_task(runner.run(
                "family", inp, on_output=lambda block: outputs.append(json.loads(block))))
            await wait_until_async(lambda: outputs, 120, what="the first result")
            assert outputs[0]["status"] == "success", outputs
            assert outputs[0]["result"] == "first turn done"
            handle = runner.active("family")
            assert handle is not None
            names.append(handle.name)

            # The tool calls left canonical command files; the host applies them.
            msgs = sorted((layout.group_ipc_dir("family") / "messages").glob("*.json"))
            assert [json.loads(p.read_text()) for p in msgs] == [
                {"type": "message", "chat_jid": "tg:2", "text": "Hello from the container"}]
            drained = await asyncio.to_thread(cli, "ipc", "drain", "--json", config=cfg_path)
            assert drained.returncode == 0, drained.stderr
            assert json.loads(drained.stdout)["applied"] == 2

            # A follow-up mid-session becomes the second turn.
            write_follow_up(layout, "family", sender="tg:42", sender_name="Alice",
                            content="and the roses?", timestamp="2026-01-01T00:00:00Z")
            await wait_until_async(lambda: len(outputs) >= 2, 60, what="the second result")
            assert outputs[1]["result"] == "second turn done"

            # Inside the running container: no real key anywhere, and no way out but the
            # proxy socket.
            half = len(REAL_KEY) // 2
            code, out = await asyncio.to_thread(container_exec, engine, handle.name, [
                "python3", "-c", SCAN_FOR_KEY, REAL_KEY[:half], REAL_KEY[half:]])
            assert code == 0 and out.startswith("scanned"), out
            assert "FOUND" not in out, out
            code, out = await asyncio.to_thread(container_exec, engine, handle.name, [
                "python3", "-c",
                "import socket,sys\n"
                f"for host in ('127.0.0.1', '10.0.2.2', '172.17.0.1'):\n"
                f"    try:\n"
                f"        socket.create_connection((host, {server.port}), timeout=3)\n"
                f"        print('CONNECTED', host)\n"
                f"    except OSError as e:\n"
                f"        print('refused', host, type(e).__name__)\n"])
            assert "CONNECTED" not in out and out.count("refused") == 3, out

            write_close(layout, "family")
            result = await asyncio.wait_for(run, 60)
            return {"result": result, "outputs": outputs}
        finally:
            await proxy.ledger.flush()
            await proxy.close()
            await runner.aclose()
            db.close()

    out = asyncio.run(scenario())
    server.stop()
    result = out["result"]
    assert result.exit_code == 0 and not result.timed_out and not result.closed_idle
    assert result.status == "success"

    # The outbox holds the text; the task is in the database.
    listed = cli("outbox", "list", "--json", config=cfg_path)
    assert listed.returncode == 0, listed.stderr
    assert [row["text"] for row in json.loads(listed.stdout)] == ["Hello from the container"]
    db = Database(cfg.db_path)
    try:
        task = db.query_one("SELECT * FROM scheduled_tasks WHERE id = 'water-plants'")
        usage = db.query("SELECT * FROM model_usage WHERE group_folder = 'family'")
    finally:
        db.close()
    assert task is not None and task["group_folder"] == "family"
    assert task["schedule_value"] == "0 8 * * *" and task["chat_jid"] == "tg:2"

    # The fake provider got the real key on every request; the container never held it.
    assert len(server.requests) == 4
    assert all(q.headers.get("Authorization") == f"Bearer {REAL_KEY}"
               for q in server.requests)
    assert sum(r["requests"] for r in usage) == 4
    assert REAL_KEY not in result.stderr_tail
    history = server.requests[-1].body["messages"]
    assert history[-1] == {"role": "user", "content": "and the roses?"}
    used = cli("usage", "--json", config=cfg_path)
    assert json.loads(used.stdout)[0]["requests"] == 4


@pytest.fixture(scope="session")
def claude_agent_image(engine, tmp_path_factory) -> str:
    """container/Dockerfile with the claude backend's wheels (the Agent SDK and its bundled
    CLI), built offline in a copy of container/ so the repository's wheelhouse stays small."""
    ctx = tmp_path_factory.mktemp("claude-image")
    shutil.copytree(REPO / "container", ctx / "container",
                    ignore=shutil.ignore_patterns("wheelhouse", "__pycache__", "tests"))
    return build_agent_image(engine, ctx, "mdclaw-agent:e2e-claude", claude=True)


@pytest.mark.slow
def test_claude_agent_in_container(tmp_path, engine, claude_agent_image, install_id,
                                   reap) -> None:
    """The bundled Claude Code CLI inside the image, network none, read-only root: tool
    call, follow-up turn, _close, session kept in the mounted ~/.claude and resumed by the
    next container; the fake Messages API got the real key."""
    from fake_models import FakeAnthropic

    key_file = tmp_path / "anthropic.key"
    key_file.write_text(REAL_KEY)
    key_file.chmod(0o600)
    api = FakeAnthropic([call("mcp__mdclaw__send_message", text="hi from claude"),
                         say("first"), say("second"), say("resumed")]).start()
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: claude}}
        models:
          claude: {{backend: claude, model: claude-sonnet-4-5, base_url: "{api.url}",
                    api_key_file: {key_file}}}
        groups:
          main: {{name: Admin, jid: "tg:1", main: true}}
          family: {{name: Family, jid: "tg:2"}}
        limits: {{container_timeout: 300s, idle_timeout: 120s, memory: 1g, pids: 256}}
        runtime: {{image: {claude_agent_image}, install_id: {install_id}}}
        """))
    cfg = load_config(cfg_path)
    reap(install_labels(cfg))
    layout = Layout(cfg.data_dir)

    async def scenario() -> list:
        runner = ContainerRunner(cfg, engine)
        proxy = CredentialProxy(layout)
        results = []
        try:
            outs: list[dict] = []
            async with proxy.for_run(cfg, "family") as fields:
                assert fields == {"backend": "claude", "model": "claude-sonnet-4-5"}
                run = asyncio.create_task(runner.run(
                    "family", ContainerInput(prompt="hi", group_folder="family",
                                             chat_jid="tg:2", **fields),
                    on_output=lambda b: outs.append(json.loads(b))))
                await wait_until_async(lambda: outs or run.done(), 180,
                                       what="the first result")
                # The CLI process holds the placeholder key and nothing holds the real one.
                half = len(REAL_KEY) // 2
                handle = runner.active("family")
                code, scan = await asyncio.to_thread(
                    container_exec, engine, handle.name,
                    ["python3", "-c", SCAN_FOR_KEY, REAL_KEY[:half], REAL_KEY[half:]])
                write_follow_up(layout, "family", sender="tg:42", sender_name="Alice",
                                content="more please", timestamp="2026-01-01T00:00:00Z")
                await wait_until_async(lambda: len(outs) >= 2 or run.done(), 120,
                                       what="second result")
                write_close(layout, "family")
                results.append((await asyncio.wait_for(run, 120), list(outs), scan))
            outs2: list[dict] = []
            async with proxy.for_run(cfg, "family") as fields:
                res = await runner.run(
                    "family", ContainerInput(prompt="again", group_folder="family",
                                             chat_jid="tg:2", is_scheduled_task=True,
                                             session_id=outs[0]["newSessionId"], **fields),
                    on_output=lambda b: outs2.append(json.loads(b)))
                results.append((res, outs2, None))
        finally:
            await proxy.close()
            await runner.aclose()
        return results

    (first, outs, scan), (second, outs2, _) = asyncio.run(scenario())
    api.stop()
    assert scan.startswith("scanned") and "FOUND" not in scan, scan
    assert int(scan.split()[3]) >= 1, scan  # the CLI's environment: placeholder only
    assert first.exit_code == 0 and first.status == "success", first.stderr_tail
    assert [o["result"] for o in outs] == ["first", "second"]
    sid = outs[0]["newSessionId"]
    assert outs[1]["newSessionId"] == sid
    msgs = [json.loads(p.read_text())
            for p in (layout.group_ipc_dir("family") / "messages").glob("*.json")]
    assert msgs == [{"type": "message", "chat_jid": "tg:2", "text": "hi from claude"}]
    assert second.exit_code == 0, second.stderr_tail
    assert outs2 == [{"status": "success", "result": "resumed", "newSessionId": sid}]
    assert "first" in json.dumps(api.requests[-1].body["messages"])
    assert all(q.headers.get("x-api-key") == REAL_KEY for q in api.requests)
    stored = list((cfg.data_dir / "sessions" / "family").rglob(f"{sid}.jsonl"))
    assert stored and REAL_KEY not in stored[0].read_text()
