"""The host <-> container contract round-trips: what one side writes, the other reads back
with the same values, and both sides have exactly the fields of mdclaw.wire.

The host side is mdclaw.wire (pydantic); the container side is the agent runner's protocol
module, which knows the contract only through the generated wire_schema.json (its freshness
is tests/test_wire_schema_fresh.py). A field added on one side only fails here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import agent_helpers  # noqa: F401 - puts the runner package on sys.path
from mdclaw import wire
from mdclaw.failures import TurnFailure
from mdclaw.runner import OutputParser, parse_all_outputs
from mdclaw.wire import ContainerInput, OutputBlock
from mdclaw_agent import protocol
from mdclaw_agent.backends import BackendError

AgentInput = protocol.ContainerInput


def snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def agreement(host: type[Any], schema_def: dict[str, Any], agent: type[Any]) -> list[str]:
    """How the host's model, the schema's definition and the agent's dataclass disagree on
    the input's fields and defaults ([] when they agree)."""
    problems = []
    host_fields = {name: (f.is_required(), f.default) for name, f in host.model_fields.items()}
    schema_fields = {snake(k): ("default" not in v, v.get("default"))
                     for k, v in schema_def["properties"].items()}
    agent_fields = {f.name: (f.default is dataclasses.MISSING, None if f.default is
                             dataclasses.MISSING else f.default)
                    for f in dataclasses.fields(agent)}
    for name in sorted(set(host_fields) | set(schema_fields) | set(agent_fields)):
        sides = {"host": host_fields.get(name), "schema": schema_fields.get(name),
                 "agent": agent_fields.get(name)}
        missing = [side for side, v in sides.items() if v is None]
        if missing:
            problems.append(f"{name}: not in {', '.join(missing)}")
            continue
        required = {side: v[0] for side, v in sides.items() if v is not None}
        defaults = {side: v[1] for side, v in sides.items() if v is not None and not v[0]}
        if len(set(required.values())) > 1 or len({json.dumps(d) for d in
                                                   defaults.values()}) > 1:
            problems.append(f"{name}: required/default differ: {sides}")
    return problems


# --------------------------------------------------------------------------- input


def test_both_sides_have_the_same_input_fields_and_defaults() -> None:
    assert agreement(ContainerInput, protocol.WIRE["$defs"]["ContainerInput"], AgentInput) == []
    assert set(protocol.WIRE["$defs"]["ContainerInput"]["required"]) == {
        "prompt", "groupFolder", "chatJid"}


def test_a_field_on_one_side_only_is_caught() -> None:
    class HostPlus(ContainerInput):
        trace_id: str = ""

    @dataclasses.dataclass(frozen=True)
    class AgentPlus(AgentInput):
        locale: str = "en"

    @dataclasses.dataclass(frozen=True)
    class AgentOtherDefault(AgentInput):
        assistant_name: str = "Bob"

    schema = protocol.WIRE["$defs"]["ContainerInput"]
    assert agreement(HostPlus, schema, AgentInput) == ["trace_id: not in schema, agent"]
    assert agreement(ContainerInput, schema, AgentPlus) == ["locale: not in host, schema"]
    assert agreement(ContainerInput, schema, AgentOtherDefault)[0].startswith(
        "assistant_name: required/default differ")


texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(prompt=texts, folder=texts, jid=texts, is_main=st.booleans(), scheduled=st.booleans(),
       name=texts, session=st.none() | texts, backend=st.sampled_from(wire.BACKENDS),
       model=st.none() | texts)
def test_host_input_reads_back_the_same_in_the_runner(prompt, folder, jid, is_main, scheduled,
                                                      name, session, backend, model) -> None:
    host = ContainerInput(prompt, folder, jid, is_main=is_main, is_scheduled_task=scheduled,
                          assistant_name=name, session_id=session, backend=backend,
                          model=model)
    agent = AgentInput.from_json(host.to_json().decode())
    assert {f: getattr(agent, f) for f in ContainerInput.model_fields} == dict(host)


def test_the_defaults_are_one_set() -> None:
    host = ContainerInput("hi", "fam", "tg:2")
    agent = AgentInput.from_json('{"prompt": "hi", "groupFolder": "fam", "chatJid": "tg:2"}')
    assert dataclasses.asdict(agent) == dict(host)
    assert (agent.backend, agent.assistant_name, agent.is_main) == ("claude", "Andy", False)
    # Nulls and empty strings are what they always were: the key left out.
    assert ContainerInput("hi", "fam", "tg:2", session_id="", model="") == host
    assert b"sessionId" not in host.to_json() and b"model" not in host.to_json()


def test_the_runner_ignores_keys_it_does_not_know_and_checks_the_rest(caplog) -> None:
    body = {"prompt": "hi", "groupFolder": "fam", "chatJid": "tg:2", "traceId": "t1",
            "secrets": {"K": "v"}, "sessionId": None}
    with caplog.at_level("INFO", logger="mdclaw_agent"):
        agent = AgentInput.from_json(json.dumps(body))
    assert agent == AgentInput("hi", "fam", "tg:2")
    assert "traceId" in caplog.text and "secrets" not in caplog.text
    for bad, message in [({"chatJid": 5}, "chatJid must be string"),
                         ({"chatJid": ...}, "'chatJid' is required"),
                         ({"assistantName": ["x"]}, "assistantName must be string"),
                         ({"isScheduledTask": 1}, "isScheduledTask must be boolean"),
                         ({"model": 3}, "model must be string")]:
        doc = {**body, **bad}
        doc = {k: v for k, v in doc.items() if v is not ...}
        with pytest.raises(protocol.InputError, match=re.escape(message)):
            AgentInput.from_json(json.dumps(doc))


# --------------------------------------------------------------------------- output blocks


def emitted(**kw: Any) -> tuple[dict[str, Any], str]:
    """What `protocol.emit` writes for `kw`, as JSON and as the raw stream."""
    out = io.StringIO()
    protocol.emit(stream=out, **kw)
    raw = out.getvalue()
    blocks = protocol.parse_outputs(raw)
    assert len(blocks) == 1
    return blocks[0], raw


causes = st.sampled_from(wire.RUNNER_CAUSES)
info = st.fixed_dictionaries({"cause": causes}, optional={
    "httpStatus": st.integers(100, 599), "apiMessage": texts,
    "retryAfter": st.integers(0, 3600) | st.floats(0, 3600, allow_nan=False),
    "limit": texts})
notices = st.none() | st.fixed_dictionaries({"cause": causes}, optional={"limit": texts})


@settings(max_examples=200, deadline=None)
@given(status=st.sampled_from(["success", "error"]), result=st.none() | texts,
       session=st.none() | texts.filter(bool), error=st.none() | texts.filter(bool),
       info=st.none() | info, notice=notices)
def test_runner_blocks_read_back_the_same_on_the_host(status, result, session, error, info,
                                                      notice) -> None:
    body, raw = emitted(status=status, result=result, new_session_id=session, error=error,
                        info=info, notice=notice)
    assert body.get("cause") != "agent_crash" or (info or {}).get("cause") == "agent_crash", \
        body  # the runner's own check passed: nothing was replaced
    # The host cuts the same block out of the stream, in one piece or byte by byte.
    whole = parse_all_outputs(raw)
    parser = OutputParser(1 << 20)
    pieces = [b for i in range(len(raw.encode())) for b in parser.feed(raw.encode()[i:i + 1])]
    assert whole == pieces and len(whole) == 1
    block = OutputBlock.read(whole[0])
    assert block is not None and block.ignored == {}
    assert block.model_dump(mode="json", by_alias=True, exclude_none=True) == {
        k: v for k, v in body.items() if v is not None}
    assert OutputBlock.read(block.to_json()) == block  # what stand-in agents write


def test_an_error_block_maps_to_the_same_failure() -> None:
    e = BackendError("model API answered HTTP 429: slow down", "rate_limited",
                     http_status=429, api_message="slow down", retry_after=7.5, limit="8k")
    body, _ = emitted(status="error", result=None, error=str(e), info=e.info(),
                      new_session_id="oai-1")
    assert body == {"status": "error", "result": None, "newSessionId": "oai-1",
                    "error": "model API answered HTTP 429: slow down", "cause": "rate_limited",
                    "httpStatus": 429, "apiMessage": "slow down", "retryAfter": 7.5,
                    "limit": "8k"}
    block = OutputBlock.read(json.dumps(body))
    assert block is not None
    f = TurnFailure.from_block(block)
    assert (f.cause, f.http_status, f.api_message, f.retry_after, f.limit, f.detail) == (
        "rate_limited", 429, "slow down", 7.5, "8k", "model API answered HTTP 429: slow down")
    assert TurnFailure.from_block(body) == f  # a mapping is read the same way


def test_the_runner_never_writes_a_block_the_host_would_not_read(caplog) -> None:
    body, _ = emitted(status="error", result=None, error="boom", info={"cause": "cosmic_rays"})
    assert body["status"] == "error" and body["cause"] == "agent_crash"
    assert "cause must be one of" in body["error"]
    body, _ = emitted(status="success", result="hi", info={"tokens": 12})
    assert body["cause"] == "agent_crash" and "unknown argument 'tokens'" in body["error"]
    body, _ = emitted(status="success", result="hi", notice={"cause": "context_too_long",
                                                            "limit": 8192})
    assert body["cause"] == "agent_crash" and "notice.limit must be string" in body["error"]


def test_the_host_reads_a_block_leniently() -> None:
    """A newer image (a key or a cause this host does not know) or a broken detail does not
    lose the answer."""
    block = OutputBlock.read(json.dumps({
        "status": "error", "result": None, "error": "x", "cause": "cosmic_rays",
        "httpStatus": "429", "retryAfter": True, "tokens": 12, "apiMessage": None}))
    assert block is not None
    assert (block.cause, block.http_status, block.retry_after, block.api_message) == (
        None, None, None, None)
    assert block.ignored == {"cause": "cosmic_rays", "httpStatus": "429", "retryAfter": True,
                             "tokens": 12}
    f = TurnFailure.from_block(block)
    assert f.cause == "agent_crash" and "cosmic_rays" in f.detail
    ok = OutputBlock.read(json.dumps({"result": "hello", "notice": {"cause": "nope"}}))
    assert ok is not None and (ok.status, ok.result, ok.notice) == ("success", "hello", None)
    assert OutputBlock.read("not json") is None and OutputBlock.read("[1, 2]") is None


def test_the_runner_takes_markers_backends_and_causes_from_the_contract() -> None:
    assert (protocol.OUTPUT_START, protocol.OUTPUT_END) == (wire.OUTPUT_START, wire.OUTPUT_END)
    assert protocol.BACKENDS == wire.BACKENDS == ("claude", "openai")
    assert protocol.CAUSES == wire.RUNNER_CAUSES
    # The markers old images write and read.
    assert (wire.OUTPUT_START, wire.OUTPUT_END) == ("---NANOCLAW_OUTPUT_START---",
                                                    "---NANOCLAW_OUTPUT_END---")
