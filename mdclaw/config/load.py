"""Reading config.yaml: YAML with line numbers, duplicate keys refused, every problem as a
ConfigIssue at its file:line with the key path, the offending value and the fix.

`load_config` returns the frozen Config or raises ConfigError listing every problem found: the
schema's (each at its key, an unknown key with the nearest valid one) and those across keys,
also those the keys in error would otherwise hide. Secret files are not looked at here:
mdclaw.config.secrets.secret_file_issues checks them in one explicit pass.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from mdclaw.config.schema import Config, cross_key_checks_deferred, cross_key_problems
from mdclaw.config.types import CrossKeyError, Problem, short_repr
from mdclaw.errors import ConfigProblem

DEFAULT_CONFIG_PATHS = (Path("config.yaml"), Path("/etc/mdclaw/config.yaml"))


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file: where, what, and the offending value (never a secret).
    A warning leaves the config valid."""

    path: str  # dotted location, e.g. groups.family.timeout
    message: str
    line: int | None = None
    severity: Literal["error", "warning"] = "error"

    def render(self, file: str) -> str:
        where = f"{file}:{self.line}" if self.line else file
        level = " warning:" if self.severity == "warning" else ""
        loc = f" {self.path}:" if self.path else ""
        return f"{where}:{level}{loc} {self.message}"

    def as_json(self, file: str) -> dict[str, Any]:
        return {"file": file, "line": self.line, "path": self.path, "message": self.message,
                "severity": self.severity}

    def sort_key(self) -> tuple[int, str]:
        """By line (problems of the whole file first), then key path."""
        return (self.line or 0, self.path)


def sorted_issues(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    return sorted(issues, key=ConfigIssue.sort_key)


@dataclass
class ConfigError(ConfigProblem):
    """The config could not be loaded; `issues` lists every problem found, by line."""

    file: str
    issues: list[ConfigIssue] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(i.render(self.file) for i in self.issues)


def find_config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """--config PATH, else $MDCLAW_CONFIG, else ./config.yaml, else /etc/mdclaw/config.yaml."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("MDCLAW_CONFIG")
    if env:
        return Path(env)
    for candidate in DEFAULT_CONFIG_PATHS:
        if candidate.exists():
            return candidate
    return DEFAULT_CONFIG_PATHS[0]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML would silently keep the last)."""


def _line_map(text: str, file: str = "") -> tuple[dict[tuple[str, ...], int], list[ConfigIssue]]:
    """Map each key path in the document to its 1-based line; also report duplicate keys."""
    lines: dict[tuple[str, ...], int] = {}
    issues: list[ConfigIssue] = []
    root = yaml.compose(text, Loader=_LineLoader)

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                if key in seen:
                    issues.append(ConfigIssue(".".join(path + (key,)), f"key {key!r} appears twice",
                                              key_node.start_mark.line + 1))
                seen.add(key)
                lines[path + (key,)] = key_node.start_mark.line + 1
                walk(value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (str(i),))

    if root is not None:
        walk(root, ())
    return lines, issues


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """Valid key names at the mapping `loc` (dict keys and list indexes are skipped)."""
    current: Any = Config
    i = 0
    while i < len(loc):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        f = current.model_fields.get(loc[i])
        if f is None:
            return []
        ann = f.annotation
        i += 1
        while True:
            origin = get_origin(ann)
            if origin is None:
                break
            args = [a for a in get_args(ann) if a is not type(None) and a is not Ellipsis]
            if origin in (dict, tuple, list):
                i += 1  # skip the key / index
                ann = args[-1] if args else None
            else:  # Union / Annotated / Literal
                inner = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
                ann = inner[0] if inner else (args[0] if args else None)
                if get_origin(ann) is None and not inner:
                    break
        current = ann
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Each key path of a YAML document (list items by index) to its 1-based line."""
    try:
        return _line_map(text)[0]
    except yaml.YAMLError:
        return {}


def line_of(path: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> int | None:
    """The line of the key at `path`, else of its nearest enclosing key that is in the file
    (a missing key is reported where its mapping is)."""
    for k in range(len(path), -1, -1):
        if path[:k] in lines:
            return lines[path[:k]]
    return None


def issue_at(path: tuple[str, ...], message: str, lines: dict[tuple[str, ...], int],
             severity: Literal["error", "warning"] = "error") -> ConfigIssue:
    return ConfigIssue(".".join(path), message, line_of(path, lines), severity)


def _error_loc(err: Any) -> tuple[str, ...]:
    # dict-key validation errors carry a "[key]" marker: report them at the key.
    return tuple(str(p) for p in err["loc"] if str(p) != "[key]")


def _issues_from_validation(e: ValidationError,
                            lines: dict[tuple[str, ...], int]) -> list[ConfigIssue]:
    out: list[ConfigIssue] = []
    for err in e.errors(include_url=False):
        loc = _error_loc(err)
        cross = (err.get("ctx") or {}).get("error")
        if isinstance(cross, CrossKeyError):  # one issue per problem, each at its own key
            out += [issue_at(loc + path, msg, lines) for path, msg in cross.problems]
            continue
        path = ".".join(loc)
        line = line_of(loc, lines)
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            key = loc[-1] if loc else "?"
            valid = _fields_at(loc[:-1])
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            msg = f"unknown key {key!r}"
            if close:
                msg += f"; did you mean {close[0]!r}?"
            elif valid:
                msg += f"; valid keys here: {', '.join(valid)}"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",) and not isinstance(
                err.get("input"), dict):
            msg = f"{msg} (got {short_repr(err['input'])})"
        out.append(ConfigIssue(path, msg, line))
    return out


def load_config(path: str | os.PathLike[str] | None = None, *, text: str | None = None) -> Config:
    """Read and validate the config file at `path` (see find_config_path).

    Returns the frozen Config. Raises ConfigError listing every problem, each with the file,
    the line where possible, the key path and the offending value.
    """
    p = find_config_path(path)
    file = str(p)
    if text is None:
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(file, [ConfigIssue("", "config file not found; pass --config PATH "
                                                 "or set MDCLAW_CONFIG")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(file, [ConfigIssue("", f"cannot read config file: {e}")]) from None
    try:
        lines, dup_issues = _line_map(text, file)
        # _LineLoader is a SafeLoader (plus line numbers): no object is ever constructed.
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(file, [ConfigIssue("", f"invalid YAML: {problem}", line)]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(file, [ConfigIssue("", f"the top level must be a mapping of keys, "
                                             f"got {type(data).__name__}", 1)])
    raw_dir = data.get("data_dir")
    if isinstance(raw_dir, str) and raw_dir and not os.path.isabs(os.path.expanduser(raw_dir)):
        # A relative data_dir is relative to the config file, not to the current directory.
        data = {**data, "data_dir": str(p.resolve().parent / raw_dir)}
    issues = list(dup_issues)
    cfg: Config | None = None
    with cross_key_checks_deferred():
        try:
            cfg = Config(**data)
            problems = cross_key_problems(cfg)[0]
        except ValidationError as e:
            issues += _issues_from_validation(e, lines)
            # The keys that are wrong on their own would hide the problems across keys: look
            # for those too, without the entries in error.
            problems = _cross_key_without(data, e)
        except TypeError as e:  # non-string keys at the top level
            issues.append(ConfigIssue("", f"invalid top-level key: {e}", 1))
            problems = []
    issues += [issue_at(path, msg, lines) for path, msg in problems]
    if issues:
        raise ConfigError(file, sorted_issues(issues))
    assert cfg is not None
    return cfg


def _is_true(value: Any) -> bool:
    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValidationError:
        return False


def _cross_key_without(data: dict[str, Any], e: ValidationError) -> list[Problem]:
    """The cross-key problems of `data` with every entry that has an error left out (a
    group, a model or a task; a whole section otherwise), but only those that cannot depend on
    what was left out. Their paths are those of `data`. Called with the check deferred."""
    dropped: set[tuple[str, ...]] = set()
    errors = {_error_loc(err) for err in e.errors(include_url=False)}
    for loc in errors:
        if not loc:
            return []  # an error about the whole document: nothing to check across
        if loc[0] in ("groups", "models", "tasks") and len(loc) > 1:
            dropped.add(loc[:2])
        else:
            dropped.add(loc[:1])
    kept: dict[str, Any] = {k: v for k, v in data.items() if (k,) not in dropped}
    names: dict[str, list[str]] = {"mains": []}
    for section in ("groups", "models"):
        entries = data.get(section)
        names[section] = [str(k) for k in entries] if isinstance(entries, dict) else []
        if section == "groups" and isinstance(entries, dict):
            # A group in error is still main when its own main key is.
            names["mains"] = [str(k) for k, v in entries.items()
                              if ("groups", str(k), "main") not in errors
                              and isinstance(v, dict) and _is_true(v.get("main", False))]
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items()
                             if (section, str(k)) not in dropped}
    task_index: list[int] = []  # index in `kept` -> index in `data`
    if isinstance(kept.get("tasks"), list):
        task_index = [n for n in range(len(kept["tasks"])) if ("tasks", str(n)) not in dropped]
        kept["tasks"] = [kept["tasks"][n] for n in task_index]
    try:
        problems, requires = cross_key_problems(Config(**kept), names)
    except (ValidationError, TypeError):
        return []  # the rest is not valid on its own either: report what was found

    def depends_on_dropped(needs: tuple[tuple[str, ...], ...]) -> bool:
        return any(d[:len(n)] == n or n[:len(d)] == d for n in needs for d in dropped)

    def original(path: tuple[str, ...]) -> tuple[str, ...]:
        if len(path) > 1 and path[0] == "tasks" and task_index:
            return ("tasks", str(task_index[int(path[1])]), *path[2:])
        return path

    return [(original(path), msg) for (path, msg), needs in zip(problems, requires, strict=True)
            if not depends_on_dropped(needs)]


def file_key_lines(path: str | os.PathLike[str] | None = None) -> dict[tuple[str, ...], int]:
    """key_lines of the config file at `path` (see find_config_path); empty when it cannot be
    read."""
    try:
        return key_lines(find_config_path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return {}
