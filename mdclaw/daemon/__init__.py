"""The daemon behind `mdclaw run`: the wiring of every component into one process.

- `core`: the `Daemon` (start-up, status, SIGHUP reload, SIGTERM drain) and `run_daemon`.
- `command`: the `run` subcommand, which mdclaw.cli lists beside mdclaw.commands.

Nothing below this package imports it; the operator page and /metrics see the running
daemon only through mdclaw.ops.view.DaemonView.
"""
