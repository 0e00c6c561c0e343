"""The documentation cannot drift: the API reference builds (every public name documented, no pdoc
warning, no broken link in README.md or docs/), and the benchmark tables are what the records hold."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_api_reference_builds_without_warnings_or_broken_links() -> None:
    got = _run("scripts/api_docs.py", "--check")
    assert got.returncode == 0, f"scripts/api_docs.py --check failed:\n{got.stderr[-4000:]}"


def test_benchmark_tables_are_rendered_from_the_records() -> None:
    got = _run("benchmarks/render.py", "--check")
    assert got.returncode == 0, f"{got.stderr}\n{got.stdout}"
