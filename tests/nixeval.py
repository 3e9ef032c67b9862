"""Helpers for the Nix tests: find nix-instantiate, evaluate the test harnesses in tests/nix/.

nixpkgs cannot be fetched on the machines these tests run on, so nothing is built. What can
be checked: every .nix file parses (Debian's nix-bin is enough, and CI installs it), and,
when NIXPKGS_LIB names a checkout of nixpkgs' lib (the nix-community/nixpkgs.lib repository),
the NixOS module and the flake's outputs evaluate against it with stubbed packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
NIX_DIR = REPO / "tests" / "nix"


def nix_instantiate() -> str:
    """Path of nix-instantiate. Skips the test when it is missing, except in CI (fails)."""
    exe = shutil.which("nix-instantiate")
    if exe:
        return exe
    if os.environ.get("CI") == "true":
        pytest.fail("nix-instantiate is missing in CI: .ci/setup-nix should have installed "
                    "Debian's nix-bin")
    pytest.skip("nix-instantiate not installed (apt-get install nix-bin)")


def nixpkgs_lib() -> Path:
    """The nixpkgs.lib checkout named by NIXPKGS_LIB; skips the test when it is unset
    (fails in CI, where .ci/run sets it).

    Set but unusable (no lib/default.nix, or nix-instantiate missing) is a failure, never a
    skip: whoever set it wants these tests to run.
    """
    value = os.environ.get("NIXPKGS_LIB")
    if not value:
        if os.environ.get("CI") == "true":
            pytest.fail("NIXPKGS_LIB is not set in CI: .ci/run takes it from "
                        "../shared/nixpkgs-lib; the Nix evaluation tests must run, not skip")
        pytest.skip("NIXPKGS_LIB is not set (point it at a nix-community/nixpkgs.lib checkout)")
    path = Path(value)
    if not (path / "lib" / "default.nix").is_file():
        pytest.fail(f"NIXPKGS_LIB={value} has no lib/default.nix; point it at a "
                    "nix-community/nixpkgs.lib checkout")
    if shutil.which("nix-instantiate") is None:
        pytest.fail("NIXPKGS_LIB is set but nix-instantiate is missing (apt-get install nix-bin)")
    return path


def nix_env(lib: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["NIXPKGS_LIB"] = str(lib)
    return env


def eval_json(file: Path, args: dict[str, str], lib: Path, timeout: float = 120,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """nix-instantiate --eval --strict --json FILE --arg NAME EXPR... (not raising)."""
    cmd = [nix_instantiate(), "--eval", "--strict", "--json", str(file)]
    for name, expr in args.items():
        cmd += ["--arg", name, expr]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**nix_env(lib), **(env or {})})


def eval_module(lib: Path, tmp_path: Path, configuration: str, *,
                allow_claude_code: bool = False) -> dict[str, Any]:
    """Evaluate nixos-module/ with `configuration` (a NixOS module as Nix text); the result.
    `allow_claude_code`: the stub nixpkgs allows the unfree claude-code."""
    r = eval_module_raw(lib, tmp_path, configuration, allow_claude_code=allow_claude_code)
    assert r.returncode == 0, f"evaluation failed:\n{r.stderr}"
    return json.loads(r.stdout)


def eval_module_raw(lib: Path, tmp_path: Path, configuration: str, *,
                    allow_claude_code: bool = False) -> subprocess.CompletedProcess[str]:
    case = tmp_path / "configuration.nix"
    case.write_text(configuration)
    return eval_json(NIX_DIR / "eval-module.nix",
                     {"nixpkgsLib": str(lib), "configuration": str(case),
                      "allowClaudeCode": "true" if allow_claude_code else "false"}, lib)


def nix_files() -> list[Path]:
    """Every .nix file of the project (tracked or not), outside build and tool directories."""
    skip = {".git", ".venv", "node_modules", "result", ".direnv", "data"}
    out = []
    for p in sorted(REPO.rglob("*.nix")):
        rel = p.relative_to(REPO)
        if not skip.intersection(rel.parts[:-1]):
            out.append(p)
    return out
