"""Subcommands of the `mdclaw` CLI, one module per area (see mdclaw.cli.COMMAND_MODULES)."""
