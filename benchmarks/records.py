"""Benchmark results as records: one JSON file per benchmark under ``benchmarks/results/``.

A record holds what produced the numbers (the command, the date, the machine, the versions) and
every row the script printed, so a table rendered from it can never disagree with the run::

    {"benchmark": "bench_memory", "date": "2026-12-06T05:10:00+00:00", "command": "python benchmarks/...",
     "machine": {"cpus": 2, "memory_gib": 23.5, "platform": "Linux-...", "python": "3.11.7"},
     "versions": {"smp": "...", "torch": "2.13.0", "tensorflow": "2.21.0", ...},
     "settings": {...}, "rows": [{...}, ...],
     "tables": [{"title": "...", "columns": ["model", "smp / torch"], "rows": [["gpt", "0.95"], ...]}],
     "headline": [{"what": "...", "value": "0.95x (0.93-0.97)"}]}

``rows`` are the measurements as data; ``tables`` are what the script printed, cell by cell, and
``headline`` its one-line results for the README. `write_record` saves the latest run of a
benchmark as ``results/<name>.json`` (a run replaces the previous record: the history is in git);
``benchmarks/render.py`` draws the tables of ``docs/benchmarks.md`` and the README's headline
table from the records.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from typing import Any

__all__ = ["RESULTS", "Table", "machine", "read_record", "versions", "write_record"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_PACKAGES = ("smp", "torch", "tensorflow-cpu", "keras", "transformers", "numpy", "mpi4py")


class Table:
    """A printed table, kept cell by cell for its record: ``add`` rows, ``print()`` it, pass it to
    `write_record`.

    Example:
        >>> t = Table("Step time", ["model", "smp / torch"])
        >>> t.add("gpt", "0.95")
        >>> t.markdown().splitlines()[2]
        '| gpt | 0.95 |'
    """

    def __init__(self, title: str, columns: list[str]) -> None:
        self.title, self.columns, self.rows = title, list(columns), []  # type: list[list[str]]

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: a row of {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in self.rows])

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "columns": self.columns, "rows": self.rows}


def machine() -> dict[str, Any]:
    """The facts of this machine that the numbers depend on."""
    try:
        with open("/proc/meminfo") as f:
            total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    except (OSError, StopIteration, ValueError):
        total_kib = 0
    return {"cpus": os.cpu_count(), "memory_gib": round(total_kib / 2**20, 1), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version()}


def versions() -> dict[str, str]:
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def write_record(name: str, rows: list[dict[str, Any]], settings: dict[str, Any] | None = None,
                 argv: list[str] | None = None, tables: list[Table] | None = None,
                 headline: list[dict[str, str]] | None = None) -> str:
    """Save ``rows`` (and the printed ``tables``, the README's ``headline`` lines: ``{"what", "value"}``)
    as the latest record of benchmark ``name`` (the script's file name without ``.py``); returns the
    file's path."""
    os.makedirs(RESULTS, exist_ok=True)
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), os.path.dirname(RESULTS.rstrip(os.sep)) + "/..")
    record = {"benchmark": name, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", shlex.quote(script), *map(shlex.quote, argv[1:])]),
              "machine": machine(), "versions": versions(), "settings": settings or {}, "rows": rows,
              "tables": [t.to_dict() for t in tables or []], "headline": list(headline or [])}
    path = os.path.join(RESULTS, f"{name}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_record(name: str) -> dict[str, Any]:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return dict(json.load(f))
