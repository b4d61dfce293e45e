"""Progress on stderr, and the machine-readable outputs (CSV, JSON) the commands write."""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def progress(items: Sequence[T], label: str) -> Iterator[T]:
    """Yield `items`, reporting `label i/n (elapsed, eta)` on stderr (one line per step off a TTY)."""
    total = len(items)
    start = time.perf_counter()
    tty = sys.stderr.isatty()
    every = 1 if tty else max(1, total // 10)
    for i, item in enumerate(items):
        yield item
        done = i + 1
        if done % every and done != total:
            continue
        elapsed = time.perf_counter() - start
        eta = elapsed / done * (total - done)
        line = f"[{label}] {done}/{total}  {elapsed:6.1f} s elapsed, ~{eta:5.1f} s left"
        sys.stderr.write(("\r" + line + ("\n" if done == total else "")) if tty else line + "\n")
        sys.stderr.flush()


def note(message: str) -> None:
    """A status line on stderr."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return None if not math.isfinite(value) else value  # full precision: thresholds are compared exactly
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_json(path: Path, data: Any) -> Path:
    """JSON with non-finite floats as null (strict JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(data), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def write_csv(path: Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """CSV with the first row's keys as header."""
    rows = [dict(r) for r in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as handle:
        if rows:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: _plain(v) for k, v in r.items()} for r in rows)
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub Markdown table; floats with 3 significant decimals."""
    if not rows:
        return "(no rows)\n"
    columns = list(columns or rows[0].keys())

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "n/a" if not math.isfinite(value) else f"{value:.3f}"
        return "n/a" if value is None else str(value)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties); NaN when either side is constant."""
    import numpy as np

    def ranks(values: Sequence[float]) -> Any:
        a = np.asarray(values, dtype=np.float64)
        order = a.argsort(kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=np.float64)
        for value in np.unique(a):  # average the ranks of ties
            tied = a == value
            r[tied] = r[tied].mean()
        return r
    if len(x) != len(y) or len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])
