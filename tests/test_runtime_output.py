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


def test_container_input_has_no_secrets_and_uses_the_seed_names() -> None:
    body = json.loads(ContainerInput(
        prompt="hi", group_folder="fam", chat_jid="tg:2", session_id="s",
        extra={"secrets": {"KEY": "v"}, "traceId": "t1"}).to_json())
    assert "secrets" not in body
    assert body == {"prompt": "hi", "groupFolder": "fam", "chatJid": "tg:2", "isMain": False,
                    "isScheduledTask": False, "assistantName": "Andy", "sessionId": "s",
                    "traceId": "t1"}
