"""The Claude Agent SDK backend: the bundled Claude Code CLI drives the conversation.

The mdclaw tools are an in-process SDK MCP server (server name `mdclaw`, so the CLI sees
`mcp__mdclaw__<tool>`). The group's session is resumed when the host passes a session id
that still exists in the group's Claude home; otherwise the conversation starts fresh. The
CLI runs with the group folder as its working directory and talks to the model through the
loopback forwarder (ANTHROPIC_BASE_URL) with a placeholder key.

The SDK is asynchronous and keeps background tasks between turns, so the whole client lives
in one coroutine on a private event loop thread; `turn()` hands it one prompt at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from pathlib import Path
from typing import Any

from mdclaw_agent.backends import BackendError, TurnResult, budget_message, classify_text
from mdclaw_agent.tools import Tool, ToolContext, run_tool

log = logging.getLogger("mdclaw_agent.claude")

MCP_SERVER_NAME = "mdclaw"
DISALLOWED_CLI_TOOLS = ("WebFetch", "WebSearch")


def tool_names(tools: list[Tool]) -> list[str]:
    """The names the CLI uses for our tools (what `allowed_tools` must list)."""
    return [f"mcp__{MCP_SERVER_NAME}__{t.name}" for t in tools]


def build_mcp_server(tools: list[Tool], ctx: ToolContext) -> Any:
    """The in-process MCP server config exposing `tools`; needs claude_agent_sdk."""
    from claude_agent_sdk import SdkMcpTool, create_sdk_mcp_server

    def make_handler(t: Tool):  # noqa: ANN202 - SDK callback
        async def handler(args: dict[str, Any]) -> dict[str, Any]:
            # Tools write files and may wait for an action result: keep the loop free.
            reply, is_error = await asyncio.to_thread(run_tool, [t], ctx, t.name, args)
            out: dict[str, Any] = {"content": [{"type": "text", "text": reply}]}
            if is_error:
                out["is_error"] = True
            return out
        return handler

    sdk_tools = [SdkMcpTool(name=t.name, description=t.description,
                            input_schema=t.parameters, handler=make_handler(t))
                 for t in tools]
    return create_sdk_mcp_server(name=MCP_SERVER_NAME, version="1.0.0", tools=sdk_tools)


def session_exists(session_id: str | None, cwd: Path) -> bool:
    """Whether the CLI has a stored session `session_id` for project `cwd`."""
    if not session_id:
        return False
    try:
        from claude_agent_sdk import get_session_info

        return get_session_info(session_id, directory=str(cwd)) is not None
    except Exception:  # noqa: BLE001 - an unreadable store means: start fresh
        return False


def build_options(*, model: str | None, system: str, tools: list[Tool], ctx: ToolContext,
                  cwd: Path, resume: str | None, env: dict[str, str],
                  extra_dirs: list[Path] | None = None) -> Any:
    """ClaudeAgentOptions for one container run."""
    from claude_agent_sdk import ClaudeAgentOptions

    return ClaudeAgentOptions(
        model=model,
        system_prompt={"type": "preset", "preset": "claude_code", "append": system},
        mcp_servers={MCP_SERVER_NAME: build_mcp_server(tools, ctx)},
        allowed_tools=tool_names(tools),
        # The container has no network: the CLI's own web tools cannot work. The mdclaw
        # web_fetch and web_search tools ask the host instead.
        disallowed_tools=list(DISALLOWED_CLI_TOOLS),
        # The container is the sandbox: no one is there to approve tool use.
        permission_mode="bypassPermissions",
        cwd=str(cwd),
        resume=resume,
        env=env,
        add_dirs=[str(d) for d in (extra_dirs or []) if d.is_dir()],
        # No settings sources: the memory files are already in the system prompt (loading
        # them again from disk would send them twice), and nothing else should change the
        # CLI's behaviour from inside the group folder.
        setting_sources=[],
    )


def collect_result(messages: list[Any]) -> tuple[str | None, str | None, str | None]:
    """(result text, session id, error) from one turn's messages."""
    from claude_agent_sdk import AssistantMessage, ResultMessage, TextBlock

    text_parts: list[str] = []
    session_id = None
    for m in messages:
        if isinstance(m, AssistantMessage):
            text_parts = [b.text for b in m.content if isinstance(b, TextBlock)] or text_parts
        if isinstance(m, ResultMessage):
            session_id = m.session_id or session_id
            if m.is_error:
                detail = m.result or ", ".join(str(e) for e in (m.errors or [])) or m.subtype
                return None, session_id, f"the model run failed: {detail}"
            return (m.result if m.result is not None else "\n".join(text_parts)), session_id, None
        sid = getattr(m, "session_id", None)
        if isinstance(sid, str) and sid:
            session_id = sid
    return ("\n".join(text_parts) or None), session_id, None


class ClaudeBackend:
    def __init__(self, *, model: str | None, system: str, tools: list[Tool], ctx: ToolContext,
                 cwd: Path, session_id: str | None, env: dict[str, str],
                 extra_dirs: list[Path] | None = None) -> None:
        self.model = model
        self.system = system
        self.tools = tools
        self.ctx = ctx
        self.cwd = cwd
        self.env = env
        self.extra_dirs = extra_dirs
        self.resume = session_id if session_exists(session_id, cwd) else None
        if session_id and not self.resume:
            log.info("session %s not found; starting a fresh conversation", session_id)
        self.session_id: str | None = self.resume
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queue: asyncio.Queue | None = None
        self._done: concurrent.futures.Future | None = None

    def options(self) -> Any:
        return build_options(model=self.model, system=self.system, tools=self.tools,
                             ctx=self.ctx, cwd=self.cwd, resume=self.resume, env=self.env,
                             extra_dirs=self.extra_dirs)

    async def _session(self, ready: concurrent.futures.Future) -> None:
        self._queue = asyncio.Queue()
        try:
            from claude_agent_sdk import ClaudeSDKClient, ResultMessage

            client = ClaudeSDKClient(self.options())
            await client.connect()
        except ImportError:
            ready.set_exception(BackendError(
                "the claude backend is not in this image (claude-agent-sdk is missing); "
                "rebuild it with container/build-wheelhouse.sh --claude", "backend_missing"))
            return
        except Exception as e:  # noqa: BLE001 - reported to the caller of start()
            ready.set_exception(BackendError(f"cannot start the Claude CLI: {e}", "agent_crash"))
            return
        ready.set_result(None)
        try:
            while True:
                text, fut = await self._queue.get()
                if text is None:
                    break
                try:
                    await client.query(text)
                    messages = []
                    async for m in client.receive_response():
                        messages.append(m)
                        if isinstance(m, ResultMessage):
                            break
                    fut.set_result(messages)
                except Exception as e:  # noqa: BLE001 - handed to the waiting turn()
                    fut.set_exception(e)
        finally:
            try:
                await client.disconnect()
            except Exception:  # noqa: BLE001 - the CLI may already be gone
                log.debug("disconnecting from the CLI failed", exc_info=True)

    def start(self) -> None:
        """Start the CLI; raises BackendError when it cannot run."""
        loop = self._loop = asyncio.new_event_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self._session(ready))

        self._thread = threading.Thread(target=run, name="mdclaw-claude", daemon=True)
        self._thread.start()
        ready.result()

    def turn(self, text: str) -> TurnResult:
        if self._loop is None or self._queue is None:
            raise BackendError("the Claude backend was not started", "agent_crash")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (text, fut))
        while True:
            try:
                messages = fut.result(timeout=1.0)
                break
            except concurrent.futures.TimeoutError:
                # The session coroutine ended (it only does so on close or a crash): nobody
                # will answer this turn.
                if self._thread is None or not self._thread.is_alive():
                    raise BackendError("the Claude session ended unexpectedly",
                                       "agent_crash") from None
            except Exception as e:  # noqa: BLE001 - SDK and CLI errors alike
                text = f"the Claude CLI failed: {e}"
                raise BackendError(text, classify_text(text),
                                   api_message=budget_message(text)) from None
        result, session_id, error = collect_result(messages)
        if session_id:
            self.session_id = session_id
        if error:
            cause = ("over_budget" if "max_budget" in error else classify_text(error))
            raise BackendError(error, cause, api_message=budget_message(error))
        return TurnResult(result, self.session_id)

    def close(self) -> None:
        if self._loop is None or self._queue is None:
            return
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (None, done))
        if self._thread is not None:
            self._thread.join(30)
