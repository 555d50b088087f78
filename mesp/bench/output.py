"""What every benchmark writes: one JSON file per measured row, read back for the report, and
its plots (files only, never a display)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def write_row(
    path: Path,
    row: Row,
    describe: Callable[[Row], str] | None = None,
    tag: str = "",
    indent: int | None = None,
) -> Row:
    """Write `row` to `path` as soon as it is measured (a later crash keeps it), and print
    its one-line description, `[tag] …`, to stderr as progress."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=indent) + ("\n" if indent is None else ""))
    if describe is not None:
        print(f"[{tag}] {describe(row)}" if tag else describe(row), file=sys.stderr, flush=True)
    return row


def load_rows(out: Path) -> list[Row]:
    """Every row JSON under OUT/rows (all tables), in a stable order."""
    rows = []
    for p in sorted((out / "rows").glob("*/*.json")):
        try:
            rows.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a row being written by a concurrent run: the next report picks it up
    return rows


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt

    return plt
