"""read_archive: the tags and image ID of a docker-archive tarball, read without the engine
(`mdclaw image load` compares them with the engine's before uploading anything)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from e2e.test_image_load_e2e import make_archive
from mdclaw.commands.containers import ArchiveImage, read_archive


def test_plain_and_gzipped_archives(tmp_path: Path) -> None:
    for compress in (False, True):
        path = tmp_path / f"image-{compress}.tar"
        image_id = make_archive(path, "mdclaw-agent:0123abcd", b"x", compress=compress)
        assert read_archive(path) == ArchiveImage(("mdclaw-agent:0123abcd",), image_id)


def test_an_archive_without_a_manifest_is_always_loaded(tmp_path: Path) -> None:
    path = tmp_path / "oci.tar"
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("index.json")
        info.size = 2
        t.addfile(info, io.BytesIO(b"{}"))
    assert read_archive(path) == ArchiveImage((), None)


def test_not_a_tarball_is_an_error(tmp_path: Path, cli) -> None:
    path = tmp_path / "junk.tar"
    path.write_bytes(b"not a tarball at all" * 100)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\nruntime:\n  socket: unix:///nonexistent\n")
    r = cli("image", "status", "--tarball", str(path), "--config", str(cfg))
    assert "Traceback" not in r.stderr
