"""Output markers: the whole-text parsers and the streaming parser agree, in any chunking."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mdclaw.runner import (
    OUTPUT_END,
    OUTPUT_START,
    ContainerInput,
    OutputParser,
    parse_all_outputs,
    parse_container_output,
)


def block(text: str) -> str:
    return f"{OUTPUT_START}\n{text}\n{OUTPUT_END}\n"


def test_last_block_all_blocks_and_none() -> None:
    raw = "log\n" + block('{"a": 1}') + "more log\n" + block('{"a": 2}') + "tail"
    assert parse_container_output(raw) == '{"a": 2}'
    assert parse_all_outputs(raw) == ['{"a": 1}', '{"a": 2}']
    assert parse_container_output("no markers here") == ""
    assert parse_container_output("") == ""
    assert parse_all_outputs("") == []


def test_an_unterminated_block_is_not_a_block() -> None:
    raw = block("one") + OUTPUT_START + "\nhalf"
    assert parse_all_outputs(raw) == ["one"]
    p = OutputParser(1024)
    assert p.feed(raw.encode()) == ["one"]


def test_streaming_parser_drops_an_oversized_block_and_continues() -> None:
    p = OutputParser(max_block_bytes=100)
    out = p.feed(block("x" * 500).encode())
    assert out == [] and p.dropped_blocks == 1
    assert p.feed(block("small").encode()) == ["small"]
    assert len(p.buf) < 200


def test_streaming_parser_memory_stays_small_outside_blocks() -> None:
    p = OutputParser(max_block_bytes=1000)
    for _ in range(100):
        p.feed(b"y" * 10_000)
    assert len(p.buf) < len(OUTPUT_START)


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40).filter(
    lambda t: "---" not in t)


@settings(max_examples=200)
@given(st.lists(st.tuples(texts, texts), max_size=6), texts, st.data())
def test_any_chunking_gives_the_same_blocks(pairs, tail, data) -> None:
    raw = "".join(noise + block(body) for noise, body in pairs) + tail
    encoded = raw.encode()
    cuts = sorted(data.draw(st.lists(st.integers(0, len(encoded)), max_size=12)))
    p = OutputParser(max_block_bytes=10_000)
    got: list[str] = []
    prev = 0
    for c in cuts + [len(encoded)]:
        got += p.feed(encoded[prev:c])
        prev = c
    assert got == parse_all_outputs(raw) == [body.strip() for _, body in pairs]


def test_container_input_has_no_secrets_and_uses_the_wire_names() -> None:
    import pytest
    from pydantic import ValidationError

    # The contract (mdclaw.wire) has no room for a secret, or for any key it does not name.
    for extra in ({"secrets": {"KEY": "v"}}, {"extra": {"traceId": "t1"}}):
        with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
            ContainerInput(prompt="hi", group_folder="fam", chat_jid="tg:2", **extra)
    raw = ContainerInput(prompt="hi", group_folder="fam", chat_jid="tg:2",
                         session_id="s").to_json()
    assert json.loads(raw) == {
        "prompt": "hi", "groupFolder": "fam", "chatJid": "tg:2", "isMain": False,
        "isScheduledTask": False, "assistantName": "Andy", "sessionId": "s",
        "backend": "claude"}
    # Byte for byte what the host has always written (json.dumps' separators, UTF-8 as is).
    assert raw == (b'{"prompt": "hi", "groupFolder": "fam", "chatJid": "tg:2", "isMain": '
                   b'false, "isScheduledTask": false, "assistantName": "Andy", "sessionId": '
                   b'"s", "backend": "claude"}')


def test_the_runner_refuses_a_folder_that_is_not_a_folder_name(tmp_path) -> None:
    import pytest

    from mdclaw.config import Config
    from mdclaw.runner import ContainerRunner
    from mdclaw.runtime.docker_engine import DockerRuntime

    runner = ContainerRunner(Config(data_dir=tmp_path / "data"),
                             DockerRuntime(f"unix://{tmp_path}/none.sock"))
    for bad in ("../etc", "a/b", "global", ""):
        with pytest.raises(ValueError):
            runner.build_spec(bad, ContainerInput("p", bad, "tg:1"))
    assert not (tmp_path / "etc").exists()


def test_build_spec_applies_hooks_limits_and_the_defaults(tmp_path) -> None:
    from mdclaw.config import Config
    from mdclaw.runner import ContainerRunner
    from mdclaw.runtime import Mount
    from mdclaw.runtime.docker_engine import DockerRuntime

    cfg = Config(data_dir=tmp_path / "data", groups={
        "main": {"name": "A", "jid": "tg:1", "main": True},
        "fam": {"name": "F", "jid": "tg:2", "network": "bridge", "tool_timeout": "45s"}},
        limits={"memory": "1g", "cpus": 1.5, "pids": 100, "tool_timeout": "5m"},
        runtime={"allowed_networks": ["bridge"]})
    runner = ContainerRunner(cfg, DockerRuntime(f"unix://{tmp_path}/none.sock"))
    seen = []

    def hook(ctx, spec):
        seen.append((ctx.folder, ctx.is_main))
        spec.env["ANTHROPIC_BASE_URL"] = "http://proxy"
        spec.mounts.append(Mount(str(ctx.ipc_dir / ".proxy.sock"), "/run/proxy.sock"))

    runner.add_spec_hook(hook)
    spec = runner.build_spec("main", ContainerInput("p", "main", "tg:1"),
                             extra_env={"X": "1"})
    assert seen == [("main", True)]
    assert spec.name.startswith("mdclaw-main-") and spec.network == "none"
    assert spec.user == "1000:1000" and spec.read_only and spec.cap_drop == ["ALL"]
    assert spec.security_opt == ["no-new-privileges"] and "/tmp" in spec.tmpfs
    assert (spec.memory, spec.cpus, spec.pids) == ("1g", 1.5, 100)
    assert spec.env["ANTHROPIC_BASE_URL"] == "http://proxy" and spec.env["X"] == "1"
    targets = {m.container: m.readonly for m in spec.mounts}
    assert targets == {"/workspace/group": False, "/workspace/ipc": False,
                       "/workspace/global": False, "/home/node/.claude": False,
                       "/workspace/proxy": True, "/run/proxy.sock": True}
    assert spec.labels["mdclaw"] == "true" and spec.labels["mdclaw.group"] == "main"
    fam = runner.build_spec("fam", ContainerInput("p", "fam", "tg:2"))
    assert fam.network == "bridge"
    # The longest bash call: the group's own limit, else the config's.
    assert (spec.env["MDCLAW_TOOL_TIMEOUT_MAX"], fam.env["MDCLAW_TOOL_TIMEOUT_MAX"]) == (
        "300", "45")
    assert {m.container: m.readonly for m in fam.mounts}["/workspace/global"] is True
    assert (tmp_path / "data" / "sessions" / "fam" / ".claude" / "settings.json").is_file()
    assert (tmp_path / "data" / "groups" / "fam").stat().st_mode & 0o2770 == 0o2770

