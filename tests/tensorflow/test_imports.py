"""Import isolation between the frontends, each checked in a clean subprocess (STYLE.md habit 1).

``import smp.tensorflow`` never imports torch; ``import smp`` and ``import smp.torch`` never import
TensorFlow or Keras. A frontend that pulled in the other framework would cost every user its
import time (~5 s for TensorFlow, ~2 s for torch) and memory, and tie their versions together.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK = """
import sys
{imports}
print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})))
"""


def _leaked(imports: str, forbidden: set[str]) -> str:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHECK.format(imports=imports, forbidden=sorted(forbidden))],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_smp_tensorflow_does_not_import_torch() -> None:
    pytest.importorskip("tensorflow")
    leaked = _leaked("import smp.tensorflow as smp\nsmp.init()\nsmp.reset()", {"torch"})
    assert leaked == "", f"import smp.tensorflow (and init) imported {leaked}"


def test_smp_and_smp_torch_do_not_import_tensorflow() -> None:
    pytest.importorskip("torch")
    leaked = _leaked("import smp\nimport smp.torch", {"tensorflow", "keras", "tf_keras"})
    assert leaked == "", f"import smp / smp.torch imported {leaked}"
