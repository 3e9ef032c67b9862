"""`mdclaw run`: the daemon in the foreground (systemd Type=notify)."""

from __future__ import annotations

import argparse

from mdclaw.config import ConfigError, check_secret_files, service_credential_secrets
from mdclaw.ops.console import exit_invalid, fail, load_or_exit


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("run", parents=[common], help="run the daemon (systemd Type=notify)")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    # Imported here for the CLI's start-up: the daemon brings in every component (the
    # orchestrator, channels, aiohttp...: over half a second), which no other command needs.
    from mdclaw.daemon.core import run_daemon

    cfg = load_or_exit(args)
    unreadable = service_credential_secrets(cfg)
    if unreadable:
        fail("cannot run here: " + ", ".join(f"{k} ({p})" for k, p in unreadable)
             + " is set in the service's credentials, which exist only inside the mdclaw "
             "service: start it with `systemctl start mdclaw`")
    try:  # the daemon refuses a bad secret file as it refuses an invalid config
        check_secret_files(cfg, args.config)
    except ConfigError as e:
        exit_invalid(e)
    return run_daemon(cfg, config_path=args.config)
