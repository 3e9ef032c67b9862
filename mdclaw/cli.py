"""The `mdclaw` command line. Each area registers its subcommands from mdclaw/commands/, and
the daemon its `run` (mdclaw/daemon/command.py).

Exit status: 0 success, 1 failure (invalid config, failed check...), 2 usage error; the
read-only commands exit 3 (database not ready), 4 (newer) or 5 (locked): see
mdclaw/commands/common.py and README's "Exit status".

A failure mdclaw raises on purpose (an `MdclawError`: its message is written for a person and
says what to do) that a command did not turn into its own message ends the command in one
line, `mdclaw: <message>`, exit status 1; with MDCLAW_DEBUG=1 in the environment its
traceback is printed first. Any other exception is a bug and keeps Python's traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from types import ModuleType

from mdclaw import __version__
from mdclaw.commands import (
    agent,
    approvals,
    backup,
    channels,
    containers,
    core,
    importer,
    ipc,
    mcp,
    people,
    schema,
    status,
    tasks,
    whatsapp,
)
from mdclaw.daemon import command as run_command
from mdclaw.errors import MdclawError

DEBUG_VAR = "MDCLAW_DEBUG"  # set (to anything but 0): an MdclawError's traceback too

# Each module has `register(subparsers, common)`; order is the order in --help.
COMMAND_MODULES: list[ModuleType] = [
    core, run_command, tasks, channels, whatsapp, containers, ipc, mcp, people, approvals,
    schema, agent, status, backup, importer,
]


class JournalFormatter(logging.Formatter):
    """`LEVEL name: message`, one line per record; under systemd (JOURNAL_STREAM set) each
    line starts with the syslog priority `<N>` so journald files it at the right level."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                logging.CRITICAL: 2}

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.journal = bool(os.environ.get("JOURNAL_STREAM"))

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\n", "\n  ")
        if self.journal:
            return f"<{self.PRIORITY.get(record.levelno, 6)}>{text}"
        return text


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="PATH", default=argparse.SUPPRESS,
                        help="config file (default: $MDCLAW_CONFIG, ./config.yaml, "
                             "/etc/mdclaw/config.yaml)")
    parser = argparse.ArgumentParser(
        prog="mdclaw", parents=[common],
        description="Self-hosted personal AI assistant host.",
    )
    parser.add_argument("--version", action="version", version=f"mdclaw {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.register(sub, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "config"):
        args.config = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except MdclawError as e:
        return one_line(e)


def one_line(e: MdclawError) -> int:
    """End the command on `e` (a failure mdclaw raised, its message for a person): one line
    on stderr, exit status 1; the traceback first with MDCLAW_DEBUG set."""
    debug = os.environ.get(DEBUG_VAR, "") not in ("", "0")
    if debug:
        traceback.print_exc()
    message = " ".join(str(e).split()) or type(e).__name__
    hint = "" if debug else f" ({DEBUG_VAR}=1 shows where it came from)"
    print(f"mdclaw: {message}{hint}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
