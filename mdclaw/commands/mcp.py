"""mcp list, mcp tools, mcp call: the MCP servers the host runs for agents (docs/mcp.md)."""

from __future__ import annotations

import argparse
import json

from mdclaw.commands.output import print_json, print_rows
from mdclaw.ops.console import fail, load_or_exit


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    g = sub.add_parser("mcp", help="MCP servers the host runs for agents")
    gsub = g.add_subparsers(dest="mcp_command", metavar="SUBCOMMAND")
    gsub.required = True
    p = gsub.add_parser("list", parents=[common],
                        help="the configured servers (and their state in the running daemon)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)
    p = gsub.add_parser("tools", parents=[common],
                        help="start the servers here and list their tools")
    p.add_argument("server", nargs="?", help="only this server")
    p.add_argument("--group", "-g", help="only the tools this group may call")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_tools)
    p = gsub.add_parser("call", parents=[common],
                        help="call a tool as a group's agent would (the same rules)")
    p.add_argument("--group", "-g", required=True, help="the group to call as")
    p.add_argument("server")
    p.add_argument("tool")
    p.add_argument("arguments", nargs="?", default="{}", help="a JSON object (default {})")
    p.add_argument("--json", action="store_true", help="the whole result as JSON")
    p.set_defaults(func=cmd_call)


def cmd_list(args: argparse.Namespace) -> int:
    from mdclaw.ops.mcp import server_rows  # the hub brings in aiohttp: only mcp needs it

    cfg = load_or_exit(args)
    print_rows(server_rows(cfg), ("server", "kind", "runs", "groups", "state", "tools",
                                  "restarts", "detail"),
               as_json=args.json, empty="(no mcp_servers configured)")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    from mdclaw.ops.mcp import tool_rows

    cfg = load_or_exit(args)
    if args.server is not None and args.server not in cfg.mcp_servers:
        fail(f"there is no MCP server {args.server!r} (mcp_servers: "
             f"{', '.join(cfg.mcp_servers) or 'none'})")
    if args.group is not None and args.group not in cfg.groups:
        fail(f"there is no group {args.group!r} in the config")
    names = [args.server] if args.server else list(cfg.mcp_servers)
    rows = tool_rows(cfg, names, args.group)
    print_rows(rows, ("name", "needs_approval", "description"), as_json=args.json,
               empty="(no tools)")
    return 1 if any(r["tool"] == "-" and not r["description"].startswith("not offered")
                    for r in rows) else 0


def cmd_call(args: argparse.Namespace) -> int:
    from mdclaw.mcp.wire import McpError
    from mdclaw.ops.mcp import call

    cfg = load_or_exit(args)
    if args.group not in cfg.groups:
        fail(f"there is no group {args.group!r} in the config")
    try:
        arguments = json.loads(args.arguments)
    except ValueError as e:
        fail(f"the arguments are not JSON: {e}", 2)
    if not isinstance(arguments, dict):
        fail("the arguments must be a JSON object", 2)
    try:
        result = call(cfg, args.group, args.server, args.tool, arguments)
    except McpError as e:
        fail(f"{args.server}__{args.tool}: {e}")
    if args.json:
        print_json(result)
    else:
        for block in result["content"]:
            if block["type"] == "text":
                print(block["text"])
            else:
                print(json.dumps(block, ensure_ascii=False))
        if result["truncated"]:
            print("[cut: the result was longer]")
    return 1 if result["isError"] else 0
