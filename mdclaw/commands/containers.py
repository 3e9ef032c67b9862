"""image build|load|status, containers list; registers the mount check for check-config."""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from mdclaw import mounts
from mdclaw.commands.core import CONFIG_CHECKS
from mdclaw.commands.output import print_json, print_rows
from mdclaw.config import Config
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.runtime import (
    LABEL,
    ContainerRuntime,
    EngineCallError,
    EngineUnavailable,
    ImageError,
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
    p.add_argument("--force", action="store_true",
                   help="load even when the engine already has the tarball's tags on the "
                        "same image")
    p.set_defaults(func=cmd_image_load)
    p = isub.add_parser("status", parents=[common],
                        help="is the engine reachable and the configured image present?")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--tarball", type=Path, default=None,
                   help="also say whether this image tarball is already loaded (so that "
                        "`mdclaw image load` skips it)")
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
    except (ImageError, EngineCallError) as e:
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


@dataclass(frozen=True)
class ArchiveImage:
    """What a docker-archive tarball holds, from its manifest.json: the image's tags and
    ID (the digest of its config, which is the image ID Docker and Podman give it)."""

    refs: tuple[str, ...]
    image_id: str | None


def read_archive(tarball: Path) -> ArchiveImage:
    """The tags and image ID of a (maybe compressed) docker-archive tarball, read without
    the engine; empty when the tarball has no single-image manifest.json (an OCI archive:
    then it is always loaded). Streams through the file once, holding one entry at a time.
    """
    try:
        with tarfile.open(tarball, "r|*") as tar:
            for member in tar:
                if member.name.lstrip("./") != "manifest.json" or not member.isfile():
                    continue
                f = tar.extractfile(member)
                manifest = json.loads(f.read(1_000_000)) if f is not None else None
                if not isinstance(manifest, list) or len(manifest) != 1:
                    break
                entry = manifest[0]
                refs = tuple(str(r) for r in entry.get("RepoTags") or ())
                config = str(entry.get("Config") or "")
                digest = config.rsplit("/", 1)[-1].removesuffix(".json")
                if digest.startswith("sha256:"):
                    digest = digest[len("sha256:"):]
                ok = len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)
                return ArchiveImage(refs, f"sha256:{digest}" if ok else None)
    except (OSError, tarfile.TarError, ValueError, EOFError) as e:
        fail(f"cannot read the image tarball {tarball}: {e}")
    return ArchiveImage((), None)


def already_loaded(rt: ContainerRuntime, archive: ArchiveImage) -> str | None:
    """The engine's image ID when it already has every tag of the archive, each on exactly
    the archive's image (same ID); else None (the tarball must be loaded)."""
    if not archive.refs or archive.image_id is None:
        return None
    for ref in archive.refs:
        info = rt.image_info(ref)
        if info is None or info.id.removeprefix("sha256:") != \
                archive.image_id.removeprefix("sha256:"):
            return None
    return archive.image_id


def cmd_image_load(args: argparse.Namespace) -> int:
    rt, cfg = _runtime(args)
    if not args.tarball.is_file():
        fail(f"no image tarball at {args.tarball}")
    try:
        if not args.force:
            archive = read_archive(args.tarball)
            present = already_loaded(rt, archive)
            if present is not None:
                print(f"{', '.join(archive.refs)} is already in the engine as {present[:19]}: "
                      "not loaded again (--force loads it anyway)")
                return 0
        refs = rt.load_image(args.tarball, progress=_progress)
    except EngineUnavailable as e:
        fail(f"container engine unreachable at {rt.description}: {e}")
    except (ImageError, EngineCallError) as e:
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
        if args.tarball is not None:
            archive = read_archive(args.tarball)
            out["tarball"] = str(args.tarball)
            out["tarball_refs"] = list(archive.refs)
            out["tarball_image_id"] = archive.image_id
            out["tarball_loaded"] = already_loaded(rt, archive) is not None
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
        if "tarball" in out:
            refs = ", ".join(archive.refs) or "(no tags)"
            if out["tarball_loaded"]:
                print(f"tarball: {args.tarball} holds {refs}, already loaded "
                      f"({str(out['tarball_image_id'])[:19]}): `mdclaw image load` skips it")
            else:
                print(f"tarball: {args.tarball} holds {refs}, not loaded yet: "
                      "`mdclaw image load` uploads it")
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
