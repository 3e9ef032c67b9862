"""Shared output helpers: a readable table for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[str], *,
                empty: str = "(none)") -> None:
    rows = list(rows)
    if not rows:
        print(empty)
        return

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        text = str(v).replace("\n", " ")
        return text if len(text) <= 60 else text[:57] + "..."

    table = [[c.upper() for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def print_rows(rows: Iterable[dict[str, Any]], columns: Sequence[str], *, as_json: bool,
               empty: str = "(none)") -> None:
    """`rows` as JSON for scripts (`--json`) or as a table of `columns` for people."""
    if as_json:
        print_json(list(rows))
    else:
        print_table(rows, columns, empty=empty)
