"""The core never imports torch or tensorflow (STYLE.md habit 1), checked in a clean subprocess."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib, pkgutil, sys
import smp
for m in pkgutil.walk_packages(smp.__path__, "smp."):
    if m.name.startswith(("smp.torch", "smp.tensorflow")):
        continue
    importlib.import_module(m.name)
leaked = sorted({"torch", "tensorflow", "keras", "transformers"} & set(sys.modules))
print(",".join(leaked))
"""


def test_importing_every_core_module_imports_no_framework() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the core imported {out.stdout.strip()}"


def test_plain_import_smp() -> None:
    subprocess.run([sys.executable, "-c", "import smp, sys; assert 'torch' not in sys.modules"], check=True)
