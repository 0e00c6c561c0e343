"""docs/config.md is the generated key table; it must match the schema."""

from __future__ import annotations

import os

from smp.config.docs import markdown_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_docs_config_md_is_generated_from_the_schema() -> None:
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    assert markdown_table() in text, "docs/config.md is stale: regenerate it with `smp config --markdown`"
