"""Every exception mdclaw defines derives from mdclaw.errors.MdclawError, through its family.

The package is walked file by file (ast), so a new module or a new class is checked without
being named here; each module-level class is imported and looked at, and a class defined
inside a function (which cannot be imported) must not look like an exception at all.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

import mdclaw
from mdclaw import errors
from mdclaw.errors import (
    ChannelError,
    ConfigProblem,
    EngineError,
    IpcError,
    MdclawError,
    StateError,
)

PACKAGE = Path(mdclaw.__file__).resolve().parent

# The exception classes under mdclaw/ that are deliberately outside MdclawError, and why.
ALLOWED_OUTSIDE = {
    # A SystemExit carrying the exit status: how a CLI command ends early (printed message,
    # status 1..5), not an error of mdclaw's. `except Exception` must not catch it.
    "mdclaw.commands.common.CommandFailed",
}

_BUILTIN_EXCEPTIONS = {n for n, o in vars(builtins).items()
                       if isinstance(o, type) and issubclass(o, BaseException)}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def exception_classes() -> tuple[dict[str, type[BaseException]], list[str]]:
    """(qualified name -> class) of every module-level exception class under mdclaw/, and the
    nested class definitions whose bases look like exceptions."""
    found: dict[str, type[BaseException]] = {}
    nested: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":  # runs the CLI when imported; defines nothing
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = _module_name(path)
        top = [n for n in tree.body if isinstance(n, ast.ClassDef)]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node not in top:
                bases = {_base_name(b) for b in node.bases}
                if any(b in _BUILTIN_EXCEPTIONS or b.endswith(("Error", "Exception"))
                       for b in bases):
                    nested.append(f"{name}:{node.lineno} {node.name}")
        if not top:
            continue
        module = importlib.import_module(name)
        for node in top:
            obj = getattr(module, node.name)
            if isinstance(obj, type) and issubclass(obj, BaseException):
                found[f"{name}.{node.name}"] = obj
    return found, nested


def outside_the_tree(classes: dict[str, type[BaseException]]) -> list[str]:
    return sorted(q for q, c in classes.items()
                  if not issubclass(c, MdclawError) and q not in ALLOWED_OUTSIDE)


def test_every_exception_class_derives_from_mdclaw_error() -> None:
    classes, nested = exception_classes()
    assert len(classes) >= 25, sorted(classes)  # the walk found the package's classes
    assert outside_the_tree(classes) == [], "derive these from a family in mdclaw.errors"
    assert nested == [], "define exception classes at module level"
    assert set(ALLOWED_OUTSIDE) <= set(classes), "the allow-list names a class that is gone"


def test_the_check_catches_a_stray_class() -> None:
    class Stray(ValueError):
        pass

    class Kept(IpcError, ValueError):
        pass

    assert outside_the_tree({"mdclaw.x.Stray": Stray, "mdclaw.x.Kept": Kept}) == [
        "mdclaw.x.Stray"]


@pytest.mark.parametrize("qualname, family, builtin", [
    ("mdclaw.config.ConfigError", ConfigProblem, None),
    ("mdclaw.config.CrossKeyError", ConfigProblem, ValueError),  # pydantic needs ValueError
    ("mdclaw.config.ServiceCredential", ConfigProblem, OSError),
    ("mdclaw.schedule.ScheduleError", ConfigProblem, ValueError),
    ("mdclaw.reconcile.ReconcileError", ConfigProblem, RuntimeError),
    ("mdclaw.runtime.EngineCallError", EngineError, None),
    ("mdclaw.runtime.EngineUnavailable", EngineError, None),
    ("mdclaw.runtime.ImageError", EngineError, None),
    ("mdclaw.proxy.ProxyError", EngineError, RuntimeError),
    ("mdclaw.orchestrator.RunFailed", EngineError, RuntimeError),
    ("mdclaw.ipc.protocol.ProtocolError", IpcError, ValueError),
    ("mdclaw.ipc.auth.Unauthorized", IpcError, None),
    ("mdclaw.ipc.apply.ApplyError", IpcError, None),
    ("mdclaw.ipc.quarantine.QuarantineError", IpcError, ValueError),
    ("mdclaw.ipc.actions.ActionFailed", IpcError, None),
    ("mdclaw.agentfs.UnsafePath", IpcError, None),
    ("mdclaw.agentfs.Rejected", IpcError, None),
    ("mdclaw.channels.base.ChannelError", ChannelError, None),
    ("mdclaw.state.db.DatabaseError", StateError, RuntimeError),
    ("mdclaw.state.outbox.OutboxError", StateError, ValueError),
    ("mdclaw.state.tasks.TaskError", StateError, ValueError),
])
def test_families_and_the_builtin_bases_callers_catch(qualname, family, builtin) -> None:
    module, _, name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, family)
    if builtin is not None:
        assert issubclass(cls, builtin)


def test_the_channel_family_is_the_channels_error() -> None:
    from mdclaw.channels import ChannelError as from_channels

    assert from_channels is ChannelError
    e = ChannelError("gone", permanent=True, retry_after=3.0, code=403)
    assert (str(e), e.permanent, e.retry_after, e.code) == ("gone", True, 3.0, 403)


def test_the_old_engine_error_name_is_gone() -> None:
    import mdclaw.runtime

    assert not hasattr(mdclaw.runtime, "RuntimeError_")
    assert "EngineCallError" in mdclaw.runtime.__all__


def test_errors_is_pure() -> None:
    tree = ast.parse(Path(errors.__file__).read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__"}, imported
