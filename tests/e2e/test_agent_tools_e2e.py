"""The openai backend's workspace tools in the real image on the real engine: a scripted
model runs `bash` to write a file and `read_file` to read it back (the file is on the host in
the group folder), an endless `bash` loop is cut at its timeout, a call over the group's
`tool_timeout` is refused, and a `write_file` outside the roots, into a read-only extra
mount or into the global folder (non-main group) is refused."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mdclaw.config import load_config
from mdclaw.paths import Layout
from mdclaw.proxy import CredentialProxy
from mdclaw.runner import ContainerInput, ContainerRunner
from mdclaw.runtime import install_labels

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fake_models import FakeOpenAI, call, say  # noqa: E402

pytestmark = pytest.mark.e2e


def test_workspace_tools_in_the_container(tmp_path, engine, real_agent_image, install_id,
                                          reap) -> None:
    server = FakeOpenAI([
        call("bash", command="echo hello-from-bash > made.txt && id -u && pwd"),
        call("read_file", path="made.txt"),
        call("bash", command="while :; do :; done", timeout=2),
        call("bash", command="true", timeout=25),
        call("write_file", path="/workspace/ipc/tasks/evil.json", content="{}"),
        call("write_file", path="../outside.txt", content="x"),
        call("read_file", path="/workspace/extra/docs/guide.txt"),
        call("write_file", path="/workspace/extra/docs/guide.txt", content="changed"),
        call("write_file", path="/workspace/global/CLAUDE.md", content="changed"),
        say("tools done"),
    ]).start()
    docs = tmp_path / "shared" / "docs"
    docs.mkdir(parents=True)
    (docs / "guide.txt").write_text("read me\n")
    docs.chmod(0o777)  # the image's user could write here but for the read-only mount
    (docs / "guide.txt").chmod(0o666)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{server.url}/v1"}}
        groups:
          main: {{name: Admin, jid: "tg:1", main: true}}
          family: {{name: Family, jid: "tg:2", tool_timeout: 20s,
                    mounts: [{{host: "{docs}", container: docs, readonly: true}}]}}
        mount_policy: {{allowed_roots: [{{path: "{tmp_path / 'shared'}"}}]}}
        limits: {{container_timeout: 120s, idle_timeout: 60s, memory: 256m, cpus: 1.0,
                  pids: 128}}
        runtime: {{image: {real_agent_image}, install_id: {install_id}}}
        """))
    cfg = load_config(cfg_path)
    reap(install_labels(cfg))
    layout = Layout(cfg.data_dir)

    async def scenario():  # noqa: ANN202
        runner = ContainerRunner(cfg, engine)
        proxy = CredentialProxy(layout)
        outs: list[dict] = []
        try:
            async with proxy.for_run(cfg, "family") as fields:
                res = await runner.run(
                    "family", ContainerInput(prompt="use your tools", group_folder="family",
                                             chat_jid="tg:2", is_scheduled_task=True,
                                             **fields),
                    on_output=lambda b: outs.append(json.loads(b)))
        finally:
            await proxy.close()
            await runner.aclose()
        return res, outs

    started = time.monotonic()
    res, outs = asyncio.run(scenario())
    took = time.monotonic() - started
    server.stop()
    assert res.exit_code == 0 and res.status == "success", res.stderr_tail
    assert outs[0]["result"] == "tools done"
    results = server.tool_results()
    assert len(results) == 9, results

    # bash wrote the file in the group folder, as the image's user; it is on the host.
    first = json.loads(results[0])
    assert first["exit_code"] == 0 and first["timed_out"] is False
    assert first["stdout"] == "1000\n/workspace/group\n"
    assert (layout.group_dir("family") / "made.txt").read_text() == "hello-from-bash\n"
    # read_file read it back.
    assert results[1] == "/workspace/group/made.txt: lines 1-1 of 1\nhello-from-bash\n"
    # The endless loop was cut at its 2 s timeout.
    loop = json.loads(results[2])
    assert loop["timed_out"] is True and loop["exit_code"] != 0
    assert 2 <= loop["duration_s"] < 10, loop
    # The group's tool_timeout (20 s) reached the container.
    assert "over this group's limit of 20 s" in results[3]
    # Writes outside the roots are refused; nothing was written there.
    assert "outside the folders the tools may use" in results[4]
    assert "outside the folders the tools may use" in results[5]
    assert not (layout.group_ipc_dir("family") / "tasks" / "evil.json").exists()
    assert not list((layout.group_ipc_dir("family") / "tasks").glob("*.json"))
    assert not (layout.groups_dir / "outside.txt").exists()
    # The read-only extra mount is readable, not writable (the mount's flag, not the
    # folder's permissions, says so); the global folder is read-only for a non-main group.
    assert results[6].endswith("read me\n")
    assert "mounted read-only" in results[7], results[7]
    assert (docs / "guide.txt").read_text() == "read me\n"
    assert "/workspace/global is read-only for this group" in results[8]
    assert took < 100
