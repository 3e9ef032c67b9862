"""Any OpenAI-compatible chat-completions endpoint (Ollama, llama.cpp server, vLLM, ...).

HTTP is done with the standard library's urllib: one non-streaming POST per model step keeps
the image free of an HTTP client package, and the runner needs nothing more — the result is
printed per turn, not per token.

The conversation history lives in memory for the life of the container; the tool-call loop is
bounded (`max_tool_rounds` model steps per user turn) so a model that keeps calling tools
cannot spin forever.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import secrets
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from mdclaw_agent.backends import BackendError, TurnResult, classify_http
from mdclaw_agent.ipc import read_json_file, write_json_atomic
from mdclaw_agent.tools import Tool, ToolContext, run_tool

log = logging.getLogger("mdclaw_agent.openai")

# The model URL is always the loopback forwarder (or a test server): never go through an
# HTTP proxy named in the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_SESSION_RE = re.compile(r"^oai-[0-9a-f]{16}$")


def _normalized_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if not isinstance(fn.get("arguments"), str):
        fn["arguments"] = json.dumps(fn.get("arguments") or {})
    return {**call, "type": call.get("type", "function"), "function": fn}


class OpenAIBackend:
    def __init__(self, *, base_url: str, api_key: str, model: str, system: str,
                 tools: list[Tool], ctx: ToolContext, max_tool_rounds: int = 16,
                 timeout: float = 300.0, session_id: str | None = None,
                 sessions_dir: Path | None = None, history_chars: int = 200_000) -> None:
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key = api_key
        self.model = model
        self.tools = tools
        self.ctx = ctx
        self.max_tool_rounds = max_tool_rounds
        self.timeout = timeout
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.sessions_dir = sessions_dir
        self.history_chars = history_chars
        self.session_id = f"oai-{secrets.token_hex(8)}"
        self.resumed = False
        self._notice: dict[str, Any] | None = None
        if session_id and _SESSION_RE.match(session_id) and sessions_dir is not None:
            history = self._load(sessions_dir / f"{session_id}.json")
            if history is not None:
                self.messages.extend(history)
                self.session_id = session_id
                self.resumed = True

    @staticmethod
    def _load(path: Path) -> list[dict[str, Any]] | None:
        """A saved conversation (without its system prompt), or None: a missing or damaged
        session file starts a fresh conversation."""
        try:
            data = read_json_file(path, limit=32 * 1024 * 1024)
        except (OSError, ValueError):
            return None
        if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
            return None
        return [m for m in data if m.get("role") != "system"]

    def _save(self) -> None:
        if self.sessions_dir is None:
            return
        try:
            write_json_atomic(self.sessions_dir, self.messages[1:], f"{self.session_id}.json")
        except OSError as e:
            log.warning("could not save the conversation: %s", e.strerror)

    def _window(self) -> list[dict[str, Any]]:
        """The system prompt and as many of the latest turns as fit in `history_chars`.

        Local models have small context windows and a group's conversation only grows; the
        oldest turns go first, always whole (a window starts at a user message, so no tool
        result is sent without the call it answers). The current turn is always kept.
        """
        system, history = self.messages[0], self.messages[1:]
        budget = self.history_chars - len(json.dumps(system))
        start = len(history)
        used = 0
        for i in range(len(history) - 1, -1, -1):
            used += len(json.dumps(history[i]))
            if history[i].get("role") == "user":
                if used > budget and start < len(history):
                    break
                start = i
        return [system] + history[start:]

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def _tool_specs(self) -> list[dict[str, Any]]:
        return [{"type": "function",
                 "function": {"name": t.name, "description": t.description,
                              "parameters": t.parameters}} for t in self.tools]

    def _post_once(self, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode("utf-8")
        # self.url is http(s): checked when the backend is made (S310: no file:// here).
        req = urllib.request.Request(self.url, data=data, method="POST", headers={  # noqa: S310
            "Content-Type": "application/json",
            "Authorization": f"Bearer {self.api_key}",
        })
        try:
            with _OPENER.open(req, timeout=self.timeout) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            try:
                detail = e.read(4000).decode("utf-8", "replace")
            except (OSError, http.client.HTTPException):
                detail = ""
            raise classify_http(e.code, detail, e.headers.get("Retry-After")) from None
        except TimeoutError:
            raise BackendError(f"no answer from the model API within {self.timeout:g} s",
                               "turn_timeout", limit=f"{self.timeout:g} s") from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise BackendError(f"no answer from the model API within {self.timeout:g} s",
                                   "turn_timeout", limit=f"{self.timeout:g} s") from None
            raise BackendError(f"cannot reach the model API: {reason}",
                               "model_unreachable") from None
        except (ConnectionError, http.client.HTTPException) as e:
            # Reset, closed without a status line, or cut off in the middle of the body.
            raise BackendError(f"the model API closed the connection: {type(e).__name__}",
                               "model_disconnected") from None
        except OSError as e:
            raise BackendError(f"cannot reach the model API: {e}", "model_unreachable") from None
        try:
            out = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BackendError("model API answered with something that is not JSON: "
                               f"{payload[:120]!r}", "model_malformed") from None
        if (not isinstance(out, dict) or not isinstance(out.get("choices"), list)
                or not out["choices"] or not isinstance(out["choices"][0], dict)):
            raise BackendError(f"model API answer has no choices: {str(out)[:300]}",
                               "model_malformed")
        return out

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """One model step. A malformed answer is asked for once more; two in a row fail the
        turn (retrying blindly would only repeat it)."""
        try:
            return self._post_once(body)
        except BackendError as e:
            if e.cause != "model_malformed":
                raise
            log.warning("malformed model answer; asking once more: %s", e)
        return self._post_once(body)

    def _step(self, body_for: Any) -> dict[str, Any]:
        """`_post(body_for())`; when the request is over the model's context, trim the
        history (to half of what was sent, the current turn always kept) and try once more.
        The tighter window stays for the rest of the conversation."""
        body = body_for()
        try:
            return self._post(body)
        except BackendError as e:
            if e.cause != "context_too_long":
                raise
            sent = len(json.dumps(body["messages"]))
            before = self.history_chars
            self.history_chars = max(1000, min(self.history_chars, sent) // 2)
            retry = body_for()
            if len(json.dumps(retry["messages"])) >= sent:
                raise  # nothing left to trim: the current turn alone is too long
            log.warning("over the model's context (%s); history trimmed from %d to %d "
                        "characters, trying once more", e.limit or "limit not given", before,
                        self.history_chars)
            out = self._post(retry)
            self._notice = {"cause": "context_too_long", **({"limit": e.limit}
                                                            if e.limit else {})}
            return out

    def turn(self, text: str) -> TurnResult:
        """Send one user turn; run the tool loop; return the assistant's final text.

        When the turn fails, it is taken out of the history again: a message the model
        refused must not ride along in every later request of this conversation.
        """
        mark = len(self.messages)
        self._notice = None
        try:
            return self._turn(text)
        except BaseException:
            del self.messages[mark:]
            raise

    def _turn(self, text: str) -> TurnResult:
        self.messages.append({"role": "user", "content": text})
        tool_specs = self._tool_specs()
        for _ in range(self.max_tool_rounds):
            def body_for() -> dict[str, Any]:
                body: dict[str, Any] = {"model": self.model, "messages": self._window()}
                if tool_specs:
                    body["tools"] = tool_specs
                return body

            message = self._step(body_for)["choices"][0].get("message") or {}
            calls = message.get("tool_calls") or []
            entry: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            if calls:
                # The history goes back to the server: arguments as the JSON string the API
                # defines, whatever form this server answered with.
                entry["tool_calls"] = [_normalized_call(c) for c in calls]
            self.messages.append(entry)
            if not calls:
                self._save()
                return TurnResult(message.get("content") or "", self.session_id, self._notice)
            for call in calls:
                fn = call.get("function") or {}
                name = fn.get("name", "")
                raw_args = fn.get("arguments")
                try:
                    # Most servers send a JSON string; some send the object itself.
                    args = raw_args if isinstance(raw_args, dict) else json.loads(
                        raw_args or "{}")
                except (json.JSONDecodeError, TypeError):
                    reply, is_error = "The arguments were not valid JSON.", True
                else:
                    try:
                        reply, is_error = run_tool(self.tools, self.ctx, name, args)
                    except Exception as e:  # noqa: BLE001 - a tool bug fails this turn only
                        raise BackendError(f"tool {name} crashed: {type(e).__name__}: {e}",
                                           "tool_crash") from None
                log.info("tool %s -> %s", name, "error" if is_error else "ok")
                self.messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                      "content": reply})
        # Out of rounds: ask once more without tools so the user still gets an answer.
        message = self._step(lambda: {"model": self.model, "messages": self._window() + [{
            "role": "user", "content": "Tool-call limit reached; answer with what you have."}]}
        )["choices"][0].get("message") or {}
        self.messages.append({"role": "assistant", "content": message.get("content")})
        self._save()
        return TurnResult(message.get("content") or "", self.session_id, self._notice)
