"""The core never imports a framework (STYLE.md habit 1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_import_pipeline_and_run_everything_without_torch_or_tensorflow() -> None:
    code = (
        "import sys, smp.pipeline as p, smp.pipeline.cli;"
        "r = p.simulate(p.build_plan('zb_v', 4, 8));"
        "p.render_svg(r.timeline); p.render_chrome_trace(r.timeline); p.render_ascii(r.timeline);"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras', 'jax')];"
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
