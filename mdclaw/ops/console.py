"""What every command line entry point shares (the subcommands of mdclaw.commands and
`mdclaw run` in mdclaw.daemon): load the config or say why not, fail with a message.

Exit status 1 for both; the full table is in mdclaw/commands/common.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from mdclaw.config import Config, ConfigError, load_config


def fail(message: str, code: int = 1) -> NoReturn:
    print(f"mdclaw: {message}", file=sys.stderr)
    raise SystemExit(code)


def load_or_exit(args: argparse.Namespace) -> Config:
    """The validated config, or every error printed to stderr and exit status 1."""
    try:
        return load_config(args.config)
    except ConfigError as e:
        exit_invalid(e)


def exit_invalid(e: ConfigError) -> NoReturn:
    """Print every problem of `e` to stderr and exit with status 1."""
    print(f"mdclaw: invalid config {e.file}:", file=sys.stderr)
    for issue in e.issues:
        print(f"  {issue.render(e.file)}", file=sys.stderr)
    raise SystemExit(1) from None
