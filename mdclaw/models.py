"""Which model a group uses, and how its endpoint is reached.

A group uses its own `model` key, else `assistant.model`, else the only configured `models:`
entry (`model_for_group`). `Upstream` is that entry as an endpoint: where requests go (a base
URL given with or without its /v1), the credential read from the entry's `api_key_file`, and
the model a request is pinned to. The credential proxy (mdclaw.proxy) forwards through it;
`mdclaw doctor` asks it `GET /v1/models` (`probe_upstream`) the same way; the container is
told only the backend and the model (`container_model_fields`), never a key or a URL.

A request body is read strictly (`read_request`) before anything in it is believed: an
object that repeats a key anywhere, or a top-level key that is `model` under another
spelling (`Model`, `MODEL`, fullwidth letters; compared after JSON's escapes are decoded, so
`"mod\u0065l"` is `model`), is refused rather than rewritten. A server may read the first of
two equal keys where Python reads the last, or match keys without case: either way it would
read a model, or a `max_tokens`, other than the one checked here.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from mdclaw.config import Config, ModelSpec, read_secret
from mdclaw.errors import EngineError

DEFAULT_BASE_URLS = {"claude": "https://api.anthropic.com", "openai": "https://api.openai.com/v1"}


class BadRequestBody(EngineError, ValueError):
    """A model request body the proxy does not forward; the message says why, for the agent."""


class NotAnObject(BadRequestBody):
    """The body is not JSON, or JSON but not an object: it names no model and no limit."""


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise BadRequestBody(f"the request body repeats the key {json.dumps(key)} in one "
                                 "object")
        seen[key] = value
    return seen


def _spells_model(key: str) -> bool:
    """`key` is `model` to a server that folds case or compatible characters, and is not
    `model` itself."""
    return key != "model" and unicodedata.normalize("NFKC", key).casefold() == "model"


def read_request(body: bytes) -> dict[str, Any]:
    """The JSON object a model request body holds, read strictly. Raises BadRequestBody when
    it is not JSON, not an object, nested too deep to read, repeats a key in any object, or
    names `model` at its top level under another spelling."""
    try:
        sent = json.loads(body, object_pairs_hook=_no_repeats)
    except BadRequestBody:
        raise
    except RecursionError:
        raise BadRequestBody("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError):
        raise NotAnObject("the request body is not JSON") from None
    if not isinstance(sent, dict):
        raise NotAnObject("the request body is not a JSON object")
    odd = sorted(k for k in sent if _spells_model(k))
    if odd:
        raise BadRequestBody(f"the request body names the model as {json.dumps(odd[0])}; "
                             'only "model" (lowercase) is accepted')
    return sent


@dataclass(frozen=True)
class Pinned:
    """A request body as it goes upstream: the bytes, the model they name, and the object
    read from them (None when the body went as it came, not being JSON)."""

    body: bytes
    model: str
    sent: dict[str, Any] | None


@dataclass(frozen=True)
class Upstream:
    """Where one group's model requests go and how they are authenticated."""

    backend: str
    model: str | None
    base_url: str
    api_key_file: Path | None = None
    allow_models: tuple[str, ...] = ()
    allow_server_tools: bool = False

    def url_for(self, path: str, query: str) -> str:
        base = self.base_url.rstrip("/")
        # Bases are given with or without their /v1 (http://host:11434/v1 for Ollama).
        rest = path[3:] if base.endswith("/v1") and path.startswith("/v1/") else path
        return base + rest + (f"?{query}" if query else "")

    def auth_headers(self) -> dict[str, str]:
        """The real credential as headers (empty for a local server without a key).

        Raises OSError if the key file went away; the message names the file only.
        """
        if self.api_key_file is None:
            return {}
        key = read_secret(self.api_key_file)
        if self.backend == "claude":
            return {"x-api-key": key}
        return {"authorization": f"Bearer {key}"}

    @classmethod
    def from_spec(cls, spec: ModelSpec | None) -> Upstream:
        if spec is None:
            return cls(backend="claude", model=None, base_url=DEFAULT_BASE_URLS["claude"])
        return cls(backend=spec.backend, model=spec.model,
                   base_url=spec.base_url or DEFAULT_BASE_URLS[spec.backend],
                   api_key_file=spec.api_key_file, allow_models=spec.allow_models,
                   allow_server_tools=spec.allow_server_tools)

    def pin(self, body: bytes) -> Pinned:
        """A request body of the agent as it goes upstream: read strictly (read_request),
        and the configured model replaces whatever it names unless that is one of
        `allow_models`; the object is written again, so the upstream reads exactly what was
        checked. Without a configured model a JSON body goes as it came once it passed the
        same reading (its own model is counted), and a body that is not JSON goes as it is.
        Raises BadRequestBody (a ValueError) when the body may not go."""
        if self.model is None:
            try:
                sent = read_request(body)
            except NotAnObject:
                return Pinned(body, "", None)
            named = sent.get("model")
            return Pinned(body, named[:128] if isinstance(named, str) else "", sent)
        sent = read_request(body)
        asked = sent.get("model")
        if not (isinstance(asked, str) and asked in self.allow_models):
            sent["model"] = self.model
        return Pinned(json.dumps(sent, separators=(",", ":")).encode(), sent["model"], sent)

    def pin_model(self, body: bytes) -> tuple[bytes, str]:
        """(the body to forward, the model it names): `pin` without the object."""
        pinned = self.pin(body)
        return pinned.body, pinned.model


def model_for_group(cfg: Config, folder: str) -> tuple[str | None, ModelSpec | None]:
    """(model key, spec) a group uses: its own `model`, else `assistant.model`, else the only
    configured model; (None, None) means the claude backend's defaults."""
    group = cfg.groups.get(folder)
    key = (group.model if group else None) or cfg.assistant.model
    if key is None and len(cfg.models) == 1:
        key = next(iter(cfg.models))
    if key is None:
        return None, None
    return key, cfg.models[key]


def container_model_fields(cfg: Config, folder: str) -> dict[str, Any]:
    """The ContainerInput fields naming the backend and model (never a key or URL)."""
    _key, spec = model_for_group(cfg, folder)
    up = Upstream.from_spec(spec)
    return {"backend": up.backend, "model": up.model}


async def probe_upstream(upstream: Upstream, within: float = 5.0) -> tuple[int | None, str]:
    """Ask the model API `GET /v1/models` the way the proxy forwards requests (same URL
    rules, same credential, same HTTP proxy settings): (HTTP status, detail), or (None, why)
    when nothing answered. The detail never holds the key."""
    url = upstream.url_for("/v1/models", "")
    try:
        headers = upstream.auth_headers()
    except OSError as e:
        return None, f"the key file cannot be read ({e.strerror or type(e).__name__})"
    if upstream.backend == "claude":
        headers["anthropic-version"] = "2023-06-01"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=within),
                                         trust_env=True) as session:
            async with session.get(url, headers=headers, allow_redirects=False) as r:
                body = (await r.content.read(2000)).decode("utf-8", "replace")
                return r.status, " ".join(body.split())[:200]
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]
