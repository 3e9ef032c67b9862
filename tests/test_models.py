"""Which model a group uses and how its endpoint is addressed (mdclaw.models), on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mdclaw.config import load_config
from mdclaw.models import (
    DEFAULT_BASE_URLS,
    BadRequestBody,
    Upstream,
    container_model_fields,
    model_for_group,
)


def test_a_group_uses_its_own_model_else_the_assistants_else_the_only_one(
        write_config) -> None:
    two = load_config(write_config("""\
        data_dir: {data_dir}
        models:
          a: {backend: openai, model: ma, base_url: "http://127.0.0.1:1/v1"}
          b: {backend: openai, model: mb, base_url: "http://127.0.0.1:2/v1"}
        assistant: {name: Andy, timezone: UTC, model: a}
        groups:
          main: {name: Main, jid: "tg:1", main: true}
          family: {name: Family, jid: "tg:-1", model: b}
        """))
    assert model_for_group(two, "family")[0] == "b"
    assert model_for_group(two, "main")[0] == "a"
    assert model_for_group(two, "not-a-group")[0] == "a"
    one = load_config(write_config("""\
        data_dir: {data_dir}
        models:
          only: {backend: openai, model: m, base_url: "http://127.0.0.1:1/v1"}
        groups:
          main: {name: Main, jid: "tg:1", main: true}
        """, name="one.yaml"))
    assert model_for_group(one, "main")[0] == "only"
    assert container_model_fields(one, "main") == {"backend": "openai", "model": "m"}
    none = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Main, jid: "tg:1", main: true}
        """, name="none.yaml"))
    assert model_for_group(none, "main") == (None, None)
    # No model: the claude backend's defaults, and the container is told no model.
    assert container_model_fields(none, "main") == {"backend": "claude", "model": None}
    assert Upstream.from_spec(None).base_url == DEFAULT_BASE_URLS["claude"]


@pytest.mark.parametrize(("base", "path", "query", "url"), [
    ("http://h:11434/v1", "/v1/chat/completions", "", "http://h:11434/v1/chat/completions"),
    ("http://h:11434/v1/", "/v1/models", "a=1", "http://h:11434/v1/models?a=1"),
    ("https://api.anthropic.com", "/v1/messages", "", "https://api.anthropic.com/v1/messages"),
])
def test_a_base_url_with_or_without_its_v1_is_not_doubled(base, path, query, url) -> None:
    assert Upstream("openai", "m", base).url_for(path, query) == url


def test_the_credential_comes_from_the_key_file_as_each_backend_wants_it(
        tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-secret\n")
    key.chmod(0o600)
    assert Upstream("claude", "c", "u", key).auth_headers() == {"x-api-key": "sk-secret"}
    assert Upstream("openai", "m", "u", key).auth_headers() == {
        "authorization": "Bearer sk-secret"}
    assert Upstream("openai", "m", "u", None).auth_headers() == {}
    key.unlink()
    with pytest.raises(OSError):
        Upstream("claude", "c", "u", key).auth_headers()


def test_the_configured_model_is_pinned_unless_an_allowed_one_is_named() -> None:
    up = Upstream("claude", "cheap", "u", allow_models=("fast",))
    body, model = up.pin_model(b'{"model": "expensive", "max_tokens": 5}')
    assert model == "cheap" and json.loads(body) == {"model": "cheap", "max_tokens": 5}
    assert up.pin_model(b'{"model": "fast"}')[1] == "fast"
    assert up.pin_model(b"{}")[1] == "cheap"
    for bad in (b"not json", b"[1, 2]", b"\xff"):
        with pytest.raises(ValueError):
            up.pin_model(bad)
    # Without a configured model the body goes as it is, and its own model is counted.
    free = Upstream("openai", None, "u")
    assert free.pin_model(b'{"model": "x"}') == (b'{"model": "x"}', "x")
    assert free.pin_model(b"junk") == (b"junk", "")


@pytest.mark.parametrize("body", [
    b'{"Model": "expensive", "messages": []}',
    b'{"MODEL": "expensive"}',
    b'{"model": "cheap", "mODEL": "expensive"}',
    b'{"\\u004dodel": "expensive"}',  # "Model" once JSON's escapes are decoded
    b'{"\\uff4d\\uff4f\\uff44\\uff45\\uff4c": "expensive"}',  # fullwidth: NFKC makes it model
])
def test_model_under_another_spelling_is_refused_not_rewritten(body: bytes) -> None:
    for up in (Upstream("claude", "cheap", "u"), Upstream("claude", None, "u")):
        with pytest.raises(BadRequestBody, match="names the model as"):
            up.pin(body)


@pytest.mark.parametrize("body", [
    b'{"model": "cheap", "model": "expensive"}',
    b'{"model": "cheap", "mod\\u0065l": "expensive"}',  # the same key once decoded
    b'{"max_tokens": 1, "max_tokens": 100000}',
    b'{"messages": [{"role": "user", "content": "x", "role": "system"}]}',  # nested
    b'{"tools": [{"input_schema": {"properties": {"a": 1, "a": 2}}}]}',
])
def test_a_body_that_repeats_a_key_anywhere_is_refused(body: bytes) -> None:
    for up in (Upstream("claude", "cheap", "u"), Upstream("claude", None, "u")):
        with pytest.raises(BadRequestBody, match="repeats the key"):
            up.pin(body)


def test_what_strict_reading_leaves_alone() -> None:
    up = Upstream("claude", "cheap", "u")
    # "mod\u0065l" is model itself: pinned like it.
    assert up.pin(b'{"mod\\u0065l": "expensive"}').model == "cheap"
    # A nested key spelled like model is the request's content (a tool's parameter), not
    # the model the upstream reads: forwarded as it is.
    nested = b'{"tools": [{"input_schema": {"properties": {"Model": {"type": "string"}}}}]}'
    pinned = up.pin(nested)
    assert pinned.sent is not None
    assert json.loads(pinned.body)["tools"][0]["input_schema"]["properties"] == {
        "Model": {"type": "string"}}
    assert json.loads(pinned.body)["model"] == "cheap"
    # Nested too deep to read: a 400, not a crash.
    with pytest.raises(BadRequestBody, match="nested too deeply"):
        up.pin(b"[" * 100_000)
    with pytest.raises(BadRequestBody, match="nested too deeply"):
        Upstream("claude", None, "u").pin(b'{"a": ' + b"[" * 100_000)
