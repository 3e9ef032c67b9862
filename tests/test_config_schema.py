"""`mdclaw config-schema`: the committed schema and reference docs match the pydantic models.

nixos-module/config-schema.json feeds the NixOS option descriptions and docs/configuration.md
is the reference people read; both are generated, and these tests fail when either is stale.
"""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from mdclaw.commands.schema import (
    JSON_SCHEMA_PATH,
    MARKDOWN_PATH,
    config_json_schema,
    render_json,
    render_markdown,
)
from mdclaw.config import Config

REGENERATE = (f"regenerate it: python -m mdclaw config-schema --json > {JSON_SCHEMA_PATH} && "
              f"python -m mdclaw config-schema > {MARKDOWN_PATH}")


def test_committed_json_schema_is_current(cli) -> None:
    r = cli("config-schema", "--json")
    assert r.returncode == 0, r.stderr
    committed = (REPO / JSON_SCHEMA_PATH).read_text(encoding="utf-8")
    assert r.stdout == committed, f"{JSON_SCHEMA_PATH} is stale; {REGENERATE}"


def test_committed_markdown_is_current(cli) -> None:
    r = cli("config-schema")
    assert r.returncode == 0, r.stderr
    committed = (REPO / MARKDOWN_PATH).read_text(encoding="utf-8")
    assert r.stdout == committed, f"{MARKDOWN_PATH} is stale; {REGENERATE}"


def _properties(schema: dict, node: dict, path: str):
    node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
    for key, prop in node.get("properties", {}).items():
        yield f"{path}{key}", prop
        for alt in [prop, *prop.get("anyOf", ()), prop.get("items", {}),
                    prop.get("additionalProperties") or {}]:
            if "$ref" in alt:
                yield from _properties(schema, alt, f"{path}{key}.")


def test_every_key_has_a_description() -> None:
    # The NixOS options and docs/configuration.md show these; an empty one helps nobody.
    schema = config_json_schema()
    missing = [p for p, prop in _properties(schema, schema, "") if not prop.get("description")]
    assert not missing, f"add description= to these fields in mdclaw/config.py: {missing}"


def test_schema_matches_the_models() -> None:
    schema = config_json_schema()
    assert list(schema["properties"]) == list(Config.model_fields)
    assert schema["additionalProperties"] is False  # unknown keys are errors
    limits = schema["$defs"]["Limits"]["properties"]
    assert limits["container_timeout"]["default"] == "30m"  # config.yaml's own duration syntax
    assert limits["max_concurrent_containers"]["maximum"] == 256
    assert schema["$defs"]["Runtime"]["properties"]["engine"]["enum"] == [
        "docker", "podman", "apple-container"]
    assert json.loads(render_json(schema)) == schema


@pytest.mark.parametrize("section", ["## `groups.<folder>`", "## `models.<name>`",
                                     "## `channels.telegram`", "## `tasks[]`", "## `limits`"])
def test_markdown_has_a_table_per_mapping(section: str) -> None:
    md = render_markdown(config_json_schema())
    assert section in md
    table = md.split(section, 1)[1].split("\n## ", 1)[0]
    assert "| key | type | default | description |" in table


def test_markdown_rows() -> None:
    md = render_markdown(config_json_schema())
    assert "| `name` | string | **required** | Display name of the group." in md
    # jid or chats: the rule across the two keys is the config's (check-config).
    assert "| `jid` | string | `` | The chat this group answers in" in md
    assert "| `api_key_file` | path (secret file) or null | null |" in md
    assert "| `engine` | `docker` \\| `podman` \\| `apple-container` | `docker` |" in md
