"""Draw the benchmark tables of ``docs/benchmarks.md`` and the README's headline table from the records.

Each benchmark script saves its latest run as ``benchmarks/results/<script>.json`` (`records`). This
command fills every block ::

    <!-- BEGIN records:<script> -->      (docs/benchmarks.md: that record's tables)
    <!-- BEGIN records:headline -->      (README.md: every record's headline lines)

with what the records hold, so a table can never disagree with the run that produced it. ``--check``
changes nothing and fails when a file is not what the records give (the test suite runs it).

Run::

    .venv/bin/python benchmarks/render.py            # rewrite the blocks
    .venv/bin/python benchmarks/render.py --check    # exit 1 when a block is stale
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TARGETS = ("README.md", os.path.join("docs", "benchmarks.md"))
_BLOCK = re.compile(r"(<!-- BEGIN records:([\w-]+) -->\n)(.*?)(<!-- END records:\2 -->)", re.S)


def load_records() -> dict[str, dict[str, Any]]:
    """Every record under ``benchmarks/results/``, by benchmark name."""
    out = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        with open(path) as f:
            record = json.load(f)
        out[record.get("benchmark") or os.path.basename(path)[:-5]] = record
    return out


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(c.replace("|", "\\|") for c in columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows)]


def _provenance(record: dict[str, Any]) -> str:
    m, v = record.get("machine", {}), record.get("versions", {})
    frameworks = ", ".join(f"{k} {v[k]}" for k in ("torch", "tensorflow-cpu", "transformers") if k in v)
    return (f"Recorded {record['date'][:10]} on {m.get('cpus', '?')} CPUs ({m.get('processor', '?')}), "
            f"{frameworks}: `{record['command']}`")


def render_block(name: str, records: dict[str, dict[str, Any]]) -> str:
    """The text of block ``name``."""
    if name == "headline":
        rows = [[h["what"], h["value"], f"[{n}](docs/benchmarks.md#{n}py) ({r['date'][:10]})"]
                for n, r in records.items() for h in r.get("headline", [])]
        if not rows:
            return "No benchmark has a record yet (`benchmarks/results/`).\n"
        return "\n".join(_table(["what", "result", "record"], rows)) + "\n"
    record = records.get(name)
    if record is None:
        return f"No record yet: run the command above (it writes `benchmarks/results/{name}.json`).\n"
    lines = [_provenance(record), ""]
    for t in record.get("tables", []):
        lines += [f"**{t['title']}**", "", *_table(t["columns"], t["rows"]), ""]
    return "\n".join(lines)


def render_text(text: str, records: dict[str, dict[str, Any]]) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + render_block(m.group(2), records) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    args = p.parse_args(argv)
    records = load_records()
    stale = []
    for rel in TARGETS:
        path = os.path.join(ROOT, rel)
        with open(path) as f:
            text = f.read()
        new = render_text(text, records)
        if new != text:
            stale.append(rel)
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"stale benchmark tables in {', '.join(stale)}: run .venv/bin/python benchmarks/render.py",
              file=sys.stderr)
        return 1
    print(("checked: " if args.check else "rendered: ") + ", ".join(TARGETS) + f" from {len(records)} record(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
