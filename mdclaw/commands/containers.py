"""image build|load|status, containers list; registers the mount check for check-config."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mdclaw import mounts
from mdclaw.commands.common import fail, load_or_exit
from mdclaw.commands.core import CONFIG_CHECKS
from mdclaw.commands.output import print_json, print_rows
from mdclaw.config import Config
from mdclaw.runtime import (
    LABEL,
    ContainerRuntime,
    EngineUnavailable,
    ImageError,
    RuntimeError_,
    create_runtime,
    install_labels,
)

if mounts.check_config not in CONFIG_CHECKS:
    CONFIG_CHECKS.append(mounts.check_config)

CONTAINER_FIELDS = ("name", "group", "state", "image", "install", "id")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    img = sub.add_parser("image", help="the agent container image")
    isub = img.add_subparsers(dest="image_command", metavar="SUBCOMMAND")
    isub.required = True
    p = isub.add_parser("build", parents=[common],
                        help="build the agent image from container/Dockerfile")
    p.add_argument("--file", "-f", type=Path, default=Path("container/Dockerfile"),
                   help="Dockerfile (default: container/Dockerfile)")
    p.add_argument("--context", type=Path, default=Path("."),
                   help="build context directory (default: .)")
    p.add_argument("--tag", "-t", help="image tag (default: runtime.image from the config)")
    p.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="set a Dockerfile ARG, e.g. BASE_IMAGE=python:3.12-slim (repeatable)")
    p.set_defaults(func=cmd_image_build)
    p = isub.add_parser("load", parents=[common],
                        help="load an image tarball (e.g. the output of nix build "
                             ".#container-image)")
    p.add_argument("tarball", type=Path)
    p.set_defaults(func=cmd_image_load)
    p = isub.add_parser("status", parents=[common],
                        help="is the engine reachable and the configured image present?")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_image_status)

    c = sub.add_parser("containers", help="agent containers")
    csub = c.add_subparsers(dest="containers_command", metavar="SUBCOMMAND")
    csub.required = True
    p = csub.add_parser("list", parents=[common], help="containers this install started")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all-installs", action="store_true",
                   help="also containers of other mdclaw installs on this host")
    p.set_defaults(func=cmd_containers_list)


def _runtime(args: argparse.Namespace) -> tuple[ContainerRuntime, Config]:
    cfg = load_or_exit(args)
    return create_runtime(cfg.runtime), cfg


def _progress(line: str) -> None:
    print(line, flush=True)


def cmd_image_build(args: argparse.Namespace) -> int:
    rt, cfg = _runtime(args)
    tag = args.tag or cfg.runtime.image
    if not args.file.is_file():
        fail(f"no Dockerfile at {args.file}; run from the mdclaw source tree or pass --file")
    build_args = {}
    for item in args.build_arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            fail(f"--build-arg {item!r}: expected KEY=VALUE", code=2)
        build_args[key] = value
    if "MDCLAW_BACKENDS" not in build_args:
        build_args["MDCLAW_BACKENDS"] = image_backends(args.context, build_args)
        print(f"backends in the image: {build_args['MDCLAW_BACKENDS']}", flush=True)
    try:
        image_id = rt.build_image(tag, args.file, args.context, progress=_progress,
                                  build_args=build_args)
    except EngineUnavailable as e:
        fail(f"container engine unreachable at {rt.description}: {e}")
    except (ImageError, RuntimeError_) as e:
        fail(str(e))
    print(f"built {tag} ({image_id[:19]})")
    return 0


def image_backends(context: Path, build_args: dict[str, str]) -> str:
    """The agent backends an image built from `context` will carry (the mdclaw.backends
    label): claude too when the wheelhouse holds the Agent SDK, or, without wheels, when the
    build installs it from the network (WITH_CLAUDE=1)."""
    wheelhouse = context / build_args.get("WHEELHOUSE", "container/wheelhouse")
    wheels = list(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    if wheels:
        claude = any(w.name.lower().startswith("claude_agent_sdk-") for w in wheels)
    else:
        claude = build_args.get("WITH_CLAUDE") == "1"
    return "openai,claude" if claude else "openai"


def cmd_image_load(args: argparse.Namespace) -> int:
    rt, cfg = _runtime(args)
    if not args.tarball.is_file():
        fail(f"no image tarball at {args.tarball}")
    try:
        refs = rt.load_image(args.tarball, progress=_progress)
    except EngineUnavailable as e:
        fail(f"container engine unreachable at {rt.description}: {e}")
    except (ImageError, RuntimeError_) as e:
        fail(str(e))
    want = cfg.runtime.image
    print(f"loaded {', '.join(refs) or 'image'}")
    if refs and not any(r == want or r.endswith("/" + want) for r in refs):
        print(f"note: the config uses runtime.image {want!r}; tag the loaded image or change "
              "the config", file=sys.stderr)
    return 0


def cmd_image_status(args: argparse.Namespace) -> int:
    rt, cfg = _runtime(args)
    image = cfg.runtime.image
    out: dict[str, object] = {"engine": cfg.runtime.engine,
                              "socket": rt.description, "reachable": False,
                              "engine_version": None, "image": image, "present": False}
    code = 1
    try:
        out["engine_version"] = rt.ping()
        out["reachable"] = True
        info = rt.image_info(image)
        if info is not None:
            out.update(present=True, image_id=info.id, created=info.created, size=info.size,
                       backends=",".join(info.backends) if info.backends is not None
                       else "unknown (no mdclaw.backends label)")
            code = 0
    except EngineUnavailable as e:
        out["error"] = str(e)
    if args.json:
        print_json(out)
    elif not out["reachable"]:
        print(f"engine: unreachable at {rt.description}: {out.get('error')}")
    else:
        print(f"engine: {out['engine_version']}")
        if out["present"]:
            size = int(str(out["size"])) // 1_000_000
            print(f"image: {image} present ({str(out['image_id'])[:19]}, {size} MB, "
                  f"backends: {out['backends']})")
        else:
            print(f"image: {image} missing; run `mdclaw image build` or `mdclaw image load`")
    return code


def cmd_containers_list(args: argparse.Namespace) -> int:
    rt, cfg = _runtime(args)  # (asks the engine: no database needed)
    labels = {LABEL: "true"} if args.all_installs else install_labels(cfg)
    try:
        rows = [c.as_dict() for c in rt.list(labels, all=True)]
    except EngineUnavailable as e:
        fail(f"container engine unreachable at {rt.description}: {e}")
    print_rows(rows, CONTAINER_FIELDS, as_json=args.json, empty="no mdclaw containers")
    return 0
