"""`mdclaw backup`, `mdclaw restore` and `mdclaw export`: one archive of the install (while
the daemon runs), put back; one group's data as a zip. The work is mdclaw.backup."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mdclaw.backup import BackupError, export_group, make_backup, restore
from mdclaw.commands.output import print_json
from mdclaw.config import find_config_path, parse_duration
from mdclaw.config.types import format_size
from mdclaw.ops.console import fail, load_or_exit


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("backup", parents=[common],
                       help="write one archive of the database, group folders, agent "
                            "sessions, WhatsApp session and config (the daemon may run)")
    p.add_argument("--to", metavar="DIR", type=Path, default=None,
                   help="folder for the archive (default: data_dir/../mdclaw-backups)")
    p.add_argument("--keep", metavar="N", type=int, default=None,
                   help="then keep only the newest N archives in that folder")
    p.add_argument("--age-recipients", metavar="FILE", type=Path, default=None,
                   help="encrypt to the age recipients in FILE (one a line; needs the "
                        "`age` extra)")
    p.add_argument("--every", metavar="DURATION", default=None,
                   help="how often backups are scheduled (e.g. 1d), so doctor can warn "
                        "when two are missed")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_backup)
    p = sub.add_parser("restore", parents=[common],
                       help="put an archive back (verified first; the daemon must be "
                            "stopped); the data_dir there is kept, renamed")
    p.add_argument("archive", metavar="ARCHIVE", type=Path)
    p.add_argument("--data-dir", metavar="DIR", type=Path, default=None,
                   help="restore here (default: data_dir of the config)")
    p.add_argument("--identity", metavar="FILE", type=Path, default=None,
                   help="age identity file for an encrypted archive")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_restore)
    p = sub.add_parser("export", parents=[common],
                       help="everything of one group (messages, tasks, files) as a zip "
                            "with JSON")
    p.add_argument("--group", "-g", metavar="FOLDER", required=True)
    p.add_argument("--out", "-o", metavar="FILE", type=Path, default=None,
                   help="the zip to write (default: ./mdclaw-export-<group>.zip)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_export)


def _progress(enabled: bool):  # noqa: ANN202 - a callback
    def show(text: str) -> None:
        if enabled:
            print(f"  {text}", file=sys.stderr, flush=True)
    return show


def cmd_backup(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    directory = args.to or cfg.data_dir.parent / "mdclaw-backups"
    every = None
    if args.every:
        try:
            every = parse_duration(args.every).total_seconds()
        except ValueError as e:
            fail(f"--every: {e}")
    if args.keep is not None and args.keep < 1:
        fail("--keep must be at least 1")
    try:
        r = make_backup(cfg, find_config_path(getattr(args, "config", None)), directory,
                        keep=args.keep, recipient_file=args.age_recipients, every=every,
                        progress=_progress(not args.json and sys.stderr.isatty()))
    except (BackupError, OSError) as e:
        fail(f"backup failed: {e}")
    if args.json:
        print_json(r.as_json())
        return 0
    print(f"backup written: {r.archive} ({format_size(r.size)}, {r.files} files, "
          f"{format_size(r.bytes)} before compression, schema {r.schema_version}"
          f"{', encrypted' if r.encrypted else ''})")
    for s in r.skipped:
        print(f"  skipped {s['path']}: {s['reason']}")
    for old in r.removed:
        print(f"  removed old backup {old}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    data_dir = args.data_dir if args.data_dir is not None else load_or_exit(args).data_dir
    try:
        r = restore(args.archive, data_dir, identity_file=args.identity,
                    progress=_progress(not args.json and sys.stderr.isatty()))
    except (BackupError, OSError) as e:
        fail(f"restore refused: {e}" if isinstance(e, BackupError) else f"restore failed: {e}")
    if args.json:
        print_json(r.as_json())
        return 0
    print(f"restored {r.files} files into {r.data_dir} (backup of mdclaw "
          f"{r.manifest.get('mdclaw_version')}, {r.manifest.get('created_at')})")
    if r.migrated:
        print(f"  database migrated from schema {r.schema_version} to {r.migrated[-1]}")
    if r.previous:
        print(f"  the data_dir that was there is kept as {r.previous}")
    if r.config:
        print(f"  the backup's config is in {r.config}: compare it with yours")
    print("then: mdclaw doctor, and start the daemon")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    out = args.out or Path(f"mdclaw-export-{args.group}.zip")
    try:
        r = export_group(cfg, args.group, out)
    except (BackupError, OSError) as e:
        fail(f"export failed: {e}")
    if args.json:
        print_json(r)
        return 0
    print(f"exported group {args.group} to {out}: {r['messages']} messages, "
          f"{r['tasks']} tasks, {r['files']} files")
    return 0
