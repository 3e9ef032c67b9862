"""What a model request may make the provider do by itself, on the host's key.

The model APIs can run tools on their own servers inside one request: Anthropic's server
tools (web search, web fetch, code execution, the advisor, tool search, the MCP connector's
`mcp_servers` and `mcp_toolset`, a code-execution `container`), OpenAI's `web_search_options`
and hosted tools, an OpenAI-compatible router's `plugins`; and they fetch images and
documents named by URL. None of that passes the host: it reaches the network a container does
not have, past the host's web rules (mdclaw.integrations.web), and spends on the host's key
what the budget cannot see coming. So the credential proxy refuses such a request unless the
model's config entry says `allow_server_tools: true`.

Decided by the documented shape, as an allow-list, so that a tool type added later is refused
until someone looks at it:

- Anthropic Messages: a `tools` entry is a tool the client runs when it has no `type` or the
  type `custom` (the documented custom tool: `name`, `description`, `input_schema`). Every
  other type is refused, server tools and also the Anthropic-defined client tools (`bash_*`,
  `text_editor_*`, `computer_*`, `memory_*`), which the agent runner does not use. The
  top-level `mcp_servers` and `container` are refused; so is an `image` or `document` block
  whose `source` is a URL (in a message, or in a `tool_result`).
- OpenAI Chat Completions: a `tools` entry must have the type `function` or `custom` (both
  run by the client); `web_search_options` and `plugins` are refused, and an `image_url` part
  whose URL is not a `data:` URL.

`server_side_use` returns what was found, for the agent and the log, or None.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

CLAUDE_CLIENT_TOOL_TYPES = frozenset({"custom"})  # and no type at all
OPENAI_CLIENT_TOOL_TYPES = frozenset({"function", "custom"})
CLAUDE_SERVER_KEYS = ("mcp_servers", "container")
OPENAI_SERVER_KEYS = ("web_search_options", "plugins")
_SHOWN = 60  # characters of an agent-chosen name shown in a refusal


def _shown(value: Any) -> str:
    return json.dumps(value if isinstance(value, str) else type(value).__name__)[:_SHOWN]


def _entries(value: Any) -> Iterable[Mapping[str, Any]]:
    if isinstance(value, list):
        yield from (v for v in value if isinstance(v, Mapping))


def _blocks(messages: Any, content_key: str) -> Iterable[Mapping[str, Any]]:
    """The content blocks of the messages, with those nested in a `tool_result`."""
    for message in _entries(messages):
        stack = list(_entries(message.get(content_key)))
        while stack:
            block = stack.pop()
            yield block
            if block.get("type") == "tool_result":
                stack.extend(_entries(block.get("content")))


def _claude(sent: Mapping[str, Any]) -> str | None:
    for key in CLAUDE_SERVER_KEYS:
        if key in sent:
            return f"`{key}`"
    for tool in _entries(sent.get("tools")):
        kind = tool.get("type")
        if kind is not None and kind not in CLAUDE_CLIENT_TOOL_TYPES:
            return f"a tool of type {_shown(kind)}"
    for block in _blocks(sent.get("messages"), "content"):
        source = block.get("source")
        if isinstance(source, Mapping) and source.get("type") == "url":
            return f"a {_shown(block.get('type'))} block fetched by URL"
    return None


def _openai(sent: Mapping[str, Any]) -> str | None:
    for key in OPENAI_SERVER_KEYS:
        if key in sent:
            return f"`{key}`"
    for tool in _entries(sent.get("tools")):
        kind = tool.get("type")
        if kind not in OPENAI_CLIENT_TOOL_TYPES:
            return f"a tool of type {_shown(kind)}"
    for part in _blocks(sent.get("messages"), "content"):
        image = part.get("image_url") if part.get("type") == "image_url" else None
        url = image.get("url") if isinstance(image, Mapping) else image
        if image is not None and not (isinstance(url, str) and url.startswith("data:")):
            return "an image fetched by URL"
    return None


def server_side_use(backend: str, sent: Mapping[str, Any]) -> str | None:
    """What in the request body `sent` would make the provider run a tool or fetch a URL
    itself (words naming it, for the agent and the log), or None when nothing does."""
    return _claude(sent) if backend == "claude" else _openai(sent)


def refusal(found: str) -> str:
    """The message the agent gets for a refused request."""
    return (f"mdclaw's model proxy does not forward requests that make the model API run "
            f"tools or fetch URLs itself ({found}); this model's config entry would need "
            "`allow_server_tools: true`. Use the tools mdclaw gives you (web_fetch, "
            "web_search) instead")
