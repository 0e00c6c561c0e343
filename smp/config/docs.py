"""The table of configuration keys, generated from the schema (`smp config --markdown`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from smp.config.schema import KEYS, Key

_DEFAULT_TEXT = {
    "active_microbatches": "pp + 2, capped at `microbatches`",
    "memory_weight": "0.2 (`speed`), 0.8 (`memory`)",
}


def _allowed(key: Key) -> str:
    types = " or ".join(t.__name__ for t in key.types)
    if key.options:
        return ", ".join(f"`{o}`" for o in key.options)
    parts = [types]
    if key.low is not None:
        parts.append(f">= {key.low:g}")
    if key.high is not None:
        parts.append(f"<= {key.high:g}")
    if key.nullable:
        parts.append("or null")
    return " ".join(parts)


def markdown_table(include_internal: bool = False) -> str:
    """Render the keys as a markdown table (status column: supported / accepted / unsupported / internal)."""
    rows = ["| key | allowed | default | status | since | meaning |", "|---|---|---|---|---|---|"]
    for key in KEYS:
        if key.status == "internal" and not include_internal:
            continue
        name = f"`{key.name}`" + "".join(f" (alias `{a}`)" for a in key.alias)
        default = _DEFAULT_TEXT.get(key.name, f"`{key.default!r}`" if not callable(key.default) else "derived")
        rows.append(f"| {name} | {_allowed(key)} | {default} | {key.status} | {key.since} | {key.doc} |")
    return "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="smp config", description="Print the configuration keys.")
    parser.add_argument("--markdown", action="store_true", help="markdown table (the default)")
    parser.add_argument("--internal", action="store_true", help="include SMP v1 internal keys")
    args = parser.parse_args(list(argv))
    print(markdown_table(include_internal=args.internal))
    return 0
