"""The container's main program: one conversation, from the first prompt to `_close`.

stdin: one ContainerInput JSON document. stdout: one marked result per user turn (an error
block with a `cause` for a failed one). stderr: logs. Exit status 0 when the conversation
ended normally, 1 when it could not start (or a scheduled task's only turn failed), 2 when
the input was invalid.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from mdclaw_agent.backends import BackendError, system_prompt
from mdclaw_agent.forwarder import Forwarder
from mdclaw_agent.ipc import InputWatcher
from mdclaw_agent.mcptools import mcp_tools
from mdclaw_agent.protocol import PLACEHOLDER_KEY, ContainerInput, InputError, Settings, emit
from mdclaw_agent.tools import ToolContext, tools_for

log = logging.getLogger("mdclaw_agent")

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"


def make_backend(inp: ContainerInput, settings: Settings, base_url: str,  # noqa: ANN201
                 ctx: ToolContext | None = None):
    """The backend for `inp.backend`, talking to the model API at `base_url` (the root the
    proxy serves: `/v1/...` paths below it). `ctx`: the tools' context (made from `inp`
    when not given)."""
    ctx = ctx or make_context(inp, settings)
    system = system_prompt(inp, settings.group_dir, settings.global_dir)
    return _backend(inp, settings, base_url, ctx, system)


def make_context(inp: ContainerInput, settings: Settings) -> ToolContext:
    """What the tools know about this container."""
    return ToolContext(ipc_dir=settings.ipc_dir, group_folder=inp.group_folder,
                      chat_jid=inp.chat_jid, is_main=inp.is_main, group_dir=settings.group_dir,
                      action_timeout=settings.action_timeout_seconds,
                      global_dir=settings.global_dir, extra_dir=settings.extra_dir,
                      tool_timeout_max=settings.tool_timeout_max,
                      web_timeout=settings.web_timeout_seconds)


def _backend(inp: ContainerInput, settings: Settings, base_url: str,  # noqa: ANN202
             ctx: ToolContext, system: str):
    if inp.backend == "openai":
        from mdclaw_agent.backends.openai import OpenAIBackend

        tools = tools_for(inp.is_main, actions=settings.allowed_actions) + mcp_tools(
            settings.ipc_dir, settings.allowed_actions)
        return OpenAIBackend(base_url=base_url.rstrip("/") + "/v1", api_key=PLACEHOLDER_KEY,
                             model=inp.model or DEFAULT_OPENAI_MODEL, system=system,
                             tools=tools, ctx=ctx, max_tool_rounds=settings.max_tool_rounds,
                             session_id=inp.session_id,
                             sessions_dir=settings.group_dir / ".mdclaw" / "sessions",
                             history_chars=settings.history_chars)
    from mdclaw_agent.backends.claude import ClaudeBackend

    # The CLI keeps its config and sessions here; the host mounts a per-group folder at
    # ~/.claude (the rest of the root filesystem is read-only), so sessions survive the
    # container and can be resumed. Set for this process too: the SDK's session lookup
    # reads it.
    config_dir = os.environ.get("CLAUDE_CONFIG_DIR") or str(Path.home() / ".claude")
    os.environ["CLAUDE_CONFIG_DIR"] = config_dir
    env = {
        "CLAUDE_CONFIG_DIR": config_dir,
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": PLACEHOLDER_KEY,
        # Nothing but the model API is reachable; do not let the CLI try anything else.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # The container is the sandbox; this also lets the CLI skip permission prompts when
        # the runner runs as root (tests on a host; the image runs as uid 1000).
        "IS_SANDBOX": "1",
        # A dozen tools: give the model all of them up front instead of a tool search.
        "ENABLE_TOOL_SEARCH": "false",
    }
    # Claude Code keeps its own file and shell tools; ours add the IPC, memory and web tools.
    tools = tools_for(inp.is_main, workspace=False,
                      actions=settings.allowed_actions) + mcp_tools(settings.ipc_dir,
                                                                    settings.allowed_actions)
    return ClaudeBackend(model=inp.model, system=system, tools=tools, ctx=ctx,
                         cwd=settings.group_dir, session_id=inp.session_id, env=env,
                         extra_dirs=[settings.global_dir])


def _model_root(settings: Settings) -> tuple[str, Forwarder | None]:
    if settings.model_base_url:
        return settings.model_base_url, None
    fwd = Forwarder(settings.proxy_socket).start()
    return fwd.base_url, fwd


def _failed(e: BaseException, backend: object) -> None:
    """Report a failed turn as a structured error block."""
    if not isinstance(e, BackendError):
        log.exception("the turn failed with an unexpected error")
        e = BackendError(f"the agent runner failed: {type(e).__name__}: {e}", "agent_crash")
    emit("error", None, error=str(e), info=e.info(),
         new_session_id=getattr(backend, "session_id", None))


def run(inp: ContainerInput, settings: Settings) -> int:
    """Run the conversation; return the exit status."""
    if not settings.model_base_url and not settings.proxy_socket.exists():
        emit("error", None, error=f"the model proxy socket {settings.proxy_socket} is missing; "
             "the host starts it before the container", info={"cause": "proxy_missing"})
        return 1
    watcher = None if inp.is_scheduled_task else InputWatcher(
        settings.ipc_dir / "input", settings.input_poll_seconds)
    base_url, fwd = _model_root(settings)
    ctx = make_context(inp, settings)
    backend = make_backend(inp, settings, base_url, ctx)
    try:
        try:
            backend.start()
        except Exception as e:  # noqa: BLE001 - every failure is reported with its cause
            _failed(e, backend)
            return 1
        try:
            first = backend.turn(inp.prompt)
        except Exception as e:  # noqa: BLE001 - the conversation goes on
            # A failed first turn does not end the conversation: the host may already have
            # written the next message into input/, and decides itself whether to close.
            _failed(e, backend)
            if watcher is None:
                return 1
        else:
            emit("success", first.text, new_session_id=first.session_id, notice=first.notice)
            if watcher is None:  # scheduled tasks are single-turn
                return 0
        for follow_up in watcher:
            log.info("follow-up %s", follow_up.name)
            ctx.answer_in(follow_up.chat_jid)  # its answer goes where it came from
            try:
                res = backend.turn(follow_up.text)
            except Exception as e:  # noqa: BLE001 - the conversation goes on
                _failed(e, backend)
                continue
            emit("success", res.text, new_session_id=res.session_id, notice=res.notice)
        log.info("close sentinel seen; ending the session")
        return 0
    finally:
        backend.close()
        if watcher is not None:
            watcher.close()
        if fwd is not None:
            fwd.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MDCLAW_AGENT_LOG", "INFO").upper(),
                        stream=sys.stderr, format="mdclaw-agent %(levelname)s %(message)s")
    # The host stops a container with SIGTERM: end like after `_close`, via the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    settings = Settings.from_env()
    try:
        inp = ContainerInput.from_json(sys.stdin.read())
    except InputError as e:
        emit("error", None, error=str(e), info={"cause": "invalid_input"})
        return 2
    if not settings.group_dir.is_dir():
        settings.group_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(settings.group_dir if settings.group_dir.is_dir() else Path.cwd())
    return run(inp, settings)


if __name__ == "__main__":
    sys.exit(main())
