"""MCP servers run (or reached) by the host and offered to agents as tools (docs/mcp.md).

The host speaks the Model Context Protocol's client side itself, over the transports the
servers offer, and nothing of a server ever runs in an agent container:

- `wire`: JSON-RPC messages and the line framing of stdio, capped before anything is parsed;
- `transport`: a stdio server the host starts, a unix socket speaking the same framing (a
  server run as a service of its own), and streamable HTTP;
- `client`: one connection to one server: the initialize handshake (no sampling, roots or
  elicitation capability declared), the tool list, calls with a deadline, what the server
  sends unasked (bounded, answered or dropped);
- `policy`: which group may call which tool (`groups.<g>.mcp`), the tool names agents see
  (`<server>__<tool>`), the arguments' JSON Schema check, the per-group tool snapshot,
  `needs_approval`;
- `convert`: a tool result as the agent gets it (text, images and resources saved in the
  group's folder), secrets taken out, capped;
- `hub`: the daemon's servers: started at start, restarted with backoff, changed on reload,
  stopped at shutdown; calls with per-server and per-group caps; status and recent calls
  for the operator page and /metrics.

The `mcp_call` action that agents ask for is registered by mdclaw/integrations/mcp.py.
"""
