"""requirements.lock, which `make` installs from, covers pyproject.toml: every dependency, every
extra `make` installs (EXTRAS in the Makefile) and the build backend are pinned there, with
hashes, at versions their ranges allow. A dependency added to pyproject.toml (or a range
moved) without `make lock` fails here rather than on the next fresh machine.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from conftest import REPO

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]*?))?\s*\\?$")


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def make_extras() -> list[str]:
    m = re.search(r"^EXTRAS\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.M)
    assert m, "the Makefile names the extras it installs in EXTRAS"
    return m.group(1).split()


def pins(lock: str) -> dict[str, list[tuple[Version, Marker | None]]]:
    """Every `name==version [; marker]` of a lock file, by canonical name."""
    out: dict[str, list[tuple[Version, Marker | None]]] = {}
    for line in lock.splitlines():
        if m := PIN.match(line):
            marker = Marker(m.group(3)) if m.group(3) else None
            out.setdefault(canonicalize_name(m.group(1)), []).append(
                (Version(m.group(2)), marker))
    return out


def required(project: dict[str, Any], extras: list[str]) -> list[Requirement]:
    """What `make` installs: the dependencies, the extras' and the build backend."""
    names = list(project["project"]["dependencies"])
    for extra in extras:
        names += project["project"]["optional-dependencies"][extra]
    names += project["build-system"]["requires"]
    return [Requirement(n) for n in names]


def uncovered(project: dict[str, Any], extras: list[str], lock: str) -> list[str]:
    """Each requirement the lock misses or pins outside its range, in words."""
    pinned = pins(lock)
    problems = []
    for req in required(project, extras):
        if req.marker is not None and not req.marker.evaluate():
            continue
        here = [v for v, marker in pinned.get(canonicalize_name(req.name), [])
                if marker is None or marker.evaluate()]
        if not here:
            problems.append(f"{req.name} is not in requirements.lock")
        problems += [f"{req.name}: the lock pins {v}, outside {req.specifier}"
                     for v in here if not req.specifier.contains(v, prereleases=True)]
    return problems


def test_the_lock_covers_what_make_installs() -> None:
    project = pyproject()
    extras = make_extras()
    assert set(extras) <= set(project["project"]["optional-dependencies"]), extras
    problems = uncovered(project, extras, (REPO / "requirements.lock").read_text())
    assert not problems, "\n".join(problems) + "\nrun `make lock` (README)"


def test_every_pin_has_hashes() -> None:
    lines = (REPO / "requirements.lock").read_text().splitlines()
    for i, line in enumerate(lines):
        if PIN.match(line):
            assert line.rstrip().endswith("\\") and "--hash=sha256:" in lines[i + 1], line


def test_a_new_or_moved_dependency_is_found() -> None:
    lock = "pydantic==2.7.0 \\\n    --hash=sha256:00\n" \
           "setuptools==80.0 \\\n    --hash=sha256:00\n" \
           "left-pad==1.0 ; sys_platform == 'win32' \\\n    --hash=sha256:00\n"
    project = {"project": {"dependencies": ["pydantic>=2.6", "left-pad>=1", "pyyaml"],
                           "optional-dependencies": {"test": ["pydantic<2.7"]}},
               "build-system": {"requires": ["setuptools>=77"]}}
    assert uncovered(project, [], lock) == ["left-pad is not in requirements.lock",
                                            "pyyaml is not in requirements.lock"]
    assert uncovered(project, ["test"], lock)[-1] == \
        "pydantic: the lock pins 2.7.0, outside <2.7"
