"""The import contract (pyproject.toml [tool.importlinter], docs/architecture.md "Layering"):
the real tree keeps it, and `lint-imports` fails on a copy of the package with an import
planted where the contract forbids it — an upward import hidden inside a function, two
channels importing each other, an engine importing the runtime package, a circle, a module no
layer names. Also, from grimp directly: no module of mdclaw is in a circle of imports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` with the contract of `root`/pyproject.toml over `root`/mdclaw (first on
    PYTHONPATH, so the copy is what is analysed, not the installed package)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(root)
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(root / "pyproject.toml")],
                          cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """The package and its contract, copied (without bytecode)."""
    shutil.copytree(REPO / "mdclaw", tmp_path / "mdclaw",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, module: str, code: str) -> None:
    path = root / module
    path.write_text(path.read_text() + "\n\n" + code)


def test_the_tree_keeps_the_contract() -> None:
    r = lint_imports(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"Contracts: \d+ kept, 0 broken", r.stdout), r.stdout


def test_the_copy_keeps_it_until_something_is_planted(copy: Path) -> None:
    r = lint_imports(copy)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("module", "code", "broken", "named"), [
    # state is far below the daemon; the import hides in a function, as they used to
    ("mdclaw/state/groups.py",
     "def _planted() -> None:\n    from mdclaw.daemon.core import Daemon  # noqa: F401\n",
     "layers of mdclaw", "mdclaw.state.groups -> mdclaw.daemon.core"),
    # a shared query reaching up into the CLI (how the old circle began)
    ("mdclaw/ops/status.py", "from mdclaw.commands import output  # noqa: F401\n",
     "layers of mdclaw", "mdclaw.ops.status -> mdclaw.commands.output"),
    # siblings of one layer never import each other
    ("mdclaw/commands/core.py", "from mdclaw.daemon import web  # noqa: F401\n",
     "layers of mdclaw", "mdclaw.commands.core -> mdclaw.daemon.web"),
    ("mdclaw/channels/telegram.py",
     "def _planted() -> None:\n    from mdclaw.channels import http  # noqa: F401\n",
     "channels never import each other", "mdclaw.channels.telegram -> mdclaw.channels.http"),
    # the runtime's engines and the package that picks them: the circle that was
    ("mdclaw/runtime/docker_engine.py",
     "def _planted() -> None:\n    from mdclaw.runtime import create_runtime  # noqa: F401\n",
     "container engines import runtime.base", "mdclaw.runtime.docker_engine -> mdclaw.runtime"),
    # a circle inside a package the layers do not order
    ("mdclaw/ipc/protocol.py",
     "def _planted() -> None:\n    from mdclaw.ipc import apply  # noqa: F401\n",
     "no circles in any package", "mdclaw.ipc"),
])
def test_a_planted_import_breaks_the_contract(copy: Path, module: str, code: str,
                                              broken: str, named: str) -> None:
    plant(copy, module, code)
    r = lint_imports(copy)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert re.search(r"Contracts: \d+ kept, [1-9] broken", out), out
    # (an upward import also closes a circle, and a chain through it reaches up from other
    # modules: other contracts may break with the one named)
    assert re.search(rf"^{re.escape(broken)}.* BROKEN$", out, re.M), out
    assert named in out, out


def test_a_module_no_layer_names_breaks_the_contract(copy: Path) -> None:
    (copy / "mdclaw" / "newthing.py").write_text('"""Not placed in a layer yet."""\n')
    r = lint_imports(copy)
    assert r.returncode != 0
    assert "mdclaw.newthing" in r.stdout + r.stderr


def test_no_module_is_in_a_circle() -> None:
    """Every import counts (inside functions and under TYPE_CHECKING too); a package and
    the modules it re-exports from are modules like any other."""
    graph = grimp.build_graph("mdclaw", cache_dir=None)
    assert graph.find_modules_directly_imported_by("mdclaw.commands.status") >= {
        "mdclaw.ops.doctor"}  # imported inside cmd_doctor: seen
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while True:
                m = stack.pop()
                on_stack.discard(m)
                component.append(m)
                if m == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    assert circles == []
