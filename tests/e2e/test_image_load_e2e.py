"""`mdclaw image load` skips a tarball whose exact image the engine already has (the NixOS
service's pre-start runs it on every start), against the real engine.

The tarball is a small docker-archive made here (one layer, a config, manifest.json), the
format nixpkgs' dockerTools writes: tags in manifest.json, the image ID is its config's digest.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from mdclaw.commands.containers import read_archive

pytestmark = pytest.mark.e2e


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 1
    tar.addfile(info, io.BytesIO(data))


def make_archive(path: Path, tag: str, payload: bytes, compress: bool = False) -> str:
    """A docker-archive of one layer holding `payload` (gzipped with `compress`: Podman 4.3
    cannot load those, newer ones can); returns its image ID. The manifest comes last, as in
    dockerTools' streamed images."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as t:
        _add(t, "hello.txt", payload)
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["/hello.txt"], "Labels": {"mdclaw.backends": "openai"}},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": "1970-01-01T00:00:01Z", "created_by": "mdclaw test"}],
        "created": "1970-01-01T00:00:01Z",
    }, sort_keys=True).encode()
    config_id = hashlib.sha256(config).hexdigest()
    manifest = json.dumps([{"Config": f"{config_id}.json", "RepoTags": [tag],
                            "Layers": [f"{diff_id}/layer.tar"]}]).encode()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as t:
        _add(t, f"{diff_id}/layer.tar", layer_bytes)
        _add(t, f"{config_id}.json", config)
        _add(t, "manifest.json", manifest)
    path.write_bytes(gzip.compress(raw.getvalue()) if compress else raw.getvalue())
    return f"sha256:{config_id}"


@pytest.fixture
def tag(engine):
    ref = f"localhost/mdclaw-load-test:{uuid.uuid4().hex[:12]}"
    yield ref
    import docker

    try:
        engine._api().remove_image(ref, force=True)
    except docker.errors.APIError:
        pass


def config_file(tmp_path: Path, engine, image: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(f"data_dir: {tmp_path / 'data'}\nruntime:\n  engine: {engine.engine}\n"
                 f"  socket: \"{engine.base_url}\"\n  image: \"{image}\"\n")
    return p


def test_second_load_is_skipped_and_status_says_so(engine, tag: str, tmp_path: Path,
                                                   cli) -> None:
    tarball = tmp_path / "image.tar"
    image_id = make_archive(tarball, tag, os.urandom(4096))
    assert read_archive(tarball).refs == (tag,)
    assert read_archive(tarball).image_id == image_id
    cfg = config_file(tmp_path, engine, tag)

    r = cli("image", "status", "--tarball", str(tarball), "--json", "--config", str(cfg))
    status = json.loads(r.stdout)
    assert status["tarball_loaded"] is False and status["tarball_refs"] == [tag]

    t0 = time.monotonic()
    r = cli("image", "load", str(tarball), "--config", str(cfg))
    first = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "loaded" in r.stdout and "not loaded again" not in r.stdout
    info = engine.image_info(tag)
    assert info is not None and info.id.removeprefix("sha256:") == image_id[7:]

    r = cli("image", "status", "--tarball", str(tarball), "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "already loaded" in r.stdout and "skips it" in r.stdout

    t0 = time.monotonic()
    r = cli("image", "load", str(tarball), "--config", str(cfg))
    second = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert f"{tag} is already in the engine as {image_id[:19]}: not loaded again" in r.stdout
    print(f"first load {first:.2f}s, skipped load {second:.2f}s")

    # --force uploads it all the same
    r = cli("image", "load", "--force", str(tarball), "--config", str(cfg))
    assert r.returncode == 0 and "not loaded again" not in r.stdout


def test_same_tag_on_another_image_is_loaded(engine, tag: str, tmp_path: Path, cli) -> None:
    """The tag alone is not enough: a different image under it is replaced."""
    old = tmp_path / "old.tar"
    make_archive(old, tag, b"old content")
    cfg = config_file(tmp_path, engine, tag)
    assert cli("image", "load", str(old), "--config", str(cfg)).returncode == 0
    new = tmp_path / "new.tar"
    new_id = make_archive(new, tag, b"new content")
    r = cli("image", "load", str(new), "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert "not loaded again" not in r.stdout
    info = engine.image_info(tag)
    assert info is not None and info.id.removeprefix("sha256:") == new_id[7:]
