"""The running config: one holder every component reads at use time, and what a reload changes.

The daemon keeps one `LiveConfig`. Components are given it and read `live.current` where they
use a value (the runner when it builds a run, the outbox when a delivery fails, the disk
guard each round...), so a reload (SIGHUP) reaches them without anyone copying values into
them. A component that must act on a change (the queue gets more slots and starts waiting
jobs, the disk guard measures again, a transcriber is rebuilt) subscribes to it. Constructors
also take a plain Config: it is wrapped in a holder that never changes (tests, one-shot CLI
commands).

A few keys are read once at start and take effect only after a restart: they are named in
RESTART_ONLY (sections or dotted keys), their descriptions in the schema end in "(restart to
apply)", and a reload that changes one keeps the running value and logs
"reload: X changed; restart mdclaw to apply it" (`reload_config`). Every `limits.*` key is
live; tests/test_reload_limits.py reloads each through a real daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

from mdclaw.config.schema import Config

log = logging.getLogger("mdclaw.config")

# What a reload cannot change in a running daemon: the channels' connections and listeners,
# the container engine and its install labels, the data folder, the metrics listener, the
# web server's listener and token. A dotted
# key names one key of a section (e.g. "limits.x"); none of `limits` is restart-only.
RESTART_ONLY: tuple[str, ...] = ("channels", "runtime", "data_dir", "metrics", "server")

Subscriber = Callable[[Config, Config], None]


class LiveConfig:
    """The config now in force. `current` is read at use time; `subscribe(fn)` calls
    `fn(old, new)` after each `replace`. A holder made `fixed` (LiveConfig.of a plain Config)
    never changes."""

    def __init__(self, cfg: Config, *, fixed: bool = False) -> None:
        self._current = cfg
        self.fixed = fixed
        self._subscribers: list[Subscriber] = []

    @classmethod
    def of(cls, cfg: Config | LiveConfig) -> LiveConfig:
        """`cfg` itself when it is a holder, else a fixed holder of it."""
        return cfg if isinstance(cfg, LiveConfig) else cls(cfg, fixed=True)

    @property
    def current(self) -> Config:
        return self._current

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Call `fn(old, new)` after every replace (on the caller's thread, in the order of
        subscription); returns a function that unsubscribes it."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def replace(self, new: Config) -> list[str]:
        """Make `new` the config in force and tell the subscribers. A subscriber that raises
        is logged and the others still run; returns what failed, as text (empty: all
        applied)."""
        if self.fixed:
            raise TypeError("this config holder is fixed: it was made from a plain Config")
        old, self._current = self._current, new
        failed = []
        for fn in list(self._subscribers):
            try:
                fn(old, new)
            except Exception as e:  # noqa: BLE001 - one component must not stop the others
                name = getattr(fn, "__qualname__", repr(fn))
                log.exception("reload: %s could not apply the new config", name)
                failed.append(f"{name}: {e}")
        return failed


# --------------------------------------------------------------------------- reload rules

def _get(node: Any, key: str) -> Any:
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _with(node: BaseModel, parts: list[str], value: Any) -> Any:
    if len(parts) == 1:
        return node.model_copy(update={parts[0]: value})
    child = getattr(node, parts[0])
    return node.model_copy(update={parts[0]: _with(child, parts[1:], value)})


def restart_only_changes(old: Config, new: Config,
                         keys: Iterable[str] = RESTART_ONLY) -> list[str]:
    """The restart-only keys whose value differs between `old` and `new`."""
    return [k for k in keys if _get(old, k) != _get(new, k)]


def reload_config(old: Config, new: Config,
                  keys: Iterable[str] = RESTART_ONLY) -> tuple[Config, list[str]]:
    """(the config a running daemon takes from `new`, the restart-only keys it changed): `new`
    with every restart-only key kept at its running value. Each change is logged with what
    to do about it."""
    changed = restart_only_changes(old, new, keys)
    for key in changed:
        log.warning("reload: %s changed; restart mdclaw to apply it (the running daemon "
                    "keeps the old %s)", key, key)
        new = _with(new, key.split("."), _get(old, key))
    return new, changed


__all__ = ["RESTART_ONLY", "LiveConfig", "reload_config", "restart_only_changes"]
