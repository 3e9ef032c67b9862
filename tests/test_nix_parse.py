"""Every .nix file parses (`nix-instantiate --parse`). Runs in CI, which installs nix-bin."""

from __future__ import annotations

import subprocess

import pytest

from nixeval import REPO, nix_files, nix_instantiate

FILES = nix_files()


def test_the_nix_files_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in FILES}
    assert {"flake.nix", "nixos-module/default.nix", "nixos-module/settings-options.nix",
            "nixos-module/vm-test.nix", "tests/nix/eval-module.nix"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_parses(path) -> None:
    exe = nix_instantiate()
    r = subprocess.run([exe, "--parse", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{path.relative_to(REPO)} does not parse:\n{r.stderr}"


def test_a_syntax_error_is_caught(tmp_path) -> None:
    exe = nix_instantiate()
    bad = tmp_path / "bad.nix"
    bad.write_text("{ services.mdclaw = { enable = true; }\n")  # missing closing brace
    r = subprocess.run([exe, "--parse", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "error" in r.stderr


def test_the_nix_in_the_docs_parses(tmp_path) -> None:
    import re

    exe = nix_instantiate()
    text = (REPO / "docs" / "nixos.md").read_text()
    blocks = re.findall(r"```nix\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    for i, block in enumerate(blocks):
        f = tmp_path / f"block{i}.nix"
        f.write_text(block)
        r = subprocess.run([exe, "--parse", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"docs/nixos.md nix block {i} does not parse:\n{r.stderr}"
