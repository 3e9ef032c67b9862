"""An MCP server built with the SDK (`mcp`) for the failure paths of mdclaw's MCP client.

Run with the Python of the MCP servers' environment (.venv/mcp-servers, `make mcp-servers`):
`python hostile.py` serves stdio; `python hostile.py --http PORT` serves streamable HTTP on
127.0.0.1. Each tool misbehaves in one way the host must survive.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Literal

import anyio
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.types import ToolAnnotations
from pydantic import Field

READ_ONLY = ToolAnnotations(readOnlyHint=True, destructiveHint=False)
# The SDK moves the protocol off fd 1 and points fd 1 at stderr, so a stray print() cannot
# break the stream; this copy of the real stdout lets `garbage` break it on purpose.
WIRE = os.dup(1)
server = MCPServer("hostile", version="1.0")


@server.tool(annotations=READ_ONLY)
def echo(text: str) -> str:
    """Say the text back."""
    return text


@server.tool(annotations=READ_ONLY)
def strict(count: Annotated[int, Field(ge=1, le=5)], mode: Literal["fast", "slow"]) -> str:
    """A tool with a strict schema."""
    return f"{count} {mode}"


@server.tool(annotations=READ_ONLY)
def env(name: str) -> str:
    """The value of one of the server's environment variables (a server that leaks)."""
    return f"{name}={os.environ.get(name, '')}"


@server.tool(annotations=READ_ONLY)
def big(megabytes: float) -> str:
    """A result of this many megabytes."""
    return "x" * int(megabytes * 1_000_000)


@server.tool(annotations=READ_ONLY)
async def hang() -> str:
    """Never answers."""
    await anyio.sleep_forever()
    return "never"


@server.tool(annotations=READ_ONLY)
async def slow(seconds: float) -> str:
    """Answers after `seconds`."""
    started = time.perf_counter()
    await anyio.sleep(seconds)
    return f"slept {time.perf_counter() - started:.6f}"


@server.tool()
def die() -> str:
    """The process dies in the middle of the call."""
    sys.stderr.write("dying now\n")
    sys.stderr.flush()
    os._exit(3)


@server.tool(annotations=READ_ONLY)
def shout(megabytes: float) -> str:
    """Writes this many megabytes to stderr (a pipe holds 64 KiB), then answers."""
    line = "complaining loudly " * 50 + "\n"
    for _ in range(int(megabytes * 1_000_000) // len(line) + 1):
        sys.stderr.write(line)
    sys.stderr.write("last words\n")
    sys.stderr.flush()
    return "shouted"


@server.tool(annotations=READ_ONLY)
def garbage() -> str:
    """Prints garbage on stdout (where the protocol goes), then answers."""
    os.write(WIRE, b"\x00\xff this is not JSON {{{\n[1, 2\nplain words\n")
    os.write(WIRE, b"half a line without a newline, then the answer: ")
    return "answered after garbage"


@server.tool(annotations=READ_ONLY)
def image() -> Image:
    """A small PNG."""
    png = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44"
                        "ae426082")
    return Image(data=png, format="png")


@server.tool(annotations=READ_ONLY)
async def flood(count: int, ctx: Context) -> str:
    """Sends `count` log notifications before it answers."""
    for i in range(count):
        await ctx.info(f"log line {i}")
    return f"flooded {count}"


@server.tool(annotations=READ_ONLY)
async def ask_model(ctx: Context) -> str:
    """Tries to drive the client's model (sampling), which mdclaw never offers."""
    from mcp.types import SamplingMessage, TextContent

    try:
        await ctx.session.create_message(
            [SamplingMessage(role="user", content=TextContent(type="text", text="hi"))],
            max_tokens=10)
    except Exception as e:  # noqa: BLE001 - the refusal is the answer
        return f"sampling refused: {e}"
    return "sampling worked"


@server.tool(annotations=READ_ONLY)
async def grow(ctx: Context) -> str:
    """Adds a tool and says the list changed."""
    server.add_tool(lambda: "new tool here", name="added", description="Added later.",
                    annotations=READ_ONLY)
    await ctx.session.send_tool_list_changed()
    return "grown"


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
