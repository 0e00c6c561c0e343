"""Strict skips: under SMP_TEST_STRICT_SKIPS=1 a skip for a missing dev dependency fails the run,
registered skips (gpu without CUDA, Transformer Engine) stay skips. Runs pytest on a tiny temp suite
with ``transformers`` made unimportable, through the same conftest the real suite uses."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from tests.helpers.strict_skips import explain, pinned_packages

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
import sys

sys.modules["transformers"] = None  # a broken venv: `import transformers` raises ImportError
'''

CASES = '''
import pytest


def test_runs():
    pass


def test_needs_transformers():
    pytest.importorskip("transformers")


@pytest.mark.skipif(True, reason="mpiexec (mpich wheel) not installed")
def test_needs_mpiexec():
    pass


@pytest.mark.gpu
def test_on_gpu():
    import torch

    assert torch.cuda.is_available()


def test_transformer_engine():
    pytest.skip("Transformer Engine is not installed")


def test_unexplained():
    pytest.skip("the smp console script is not installed in this environment")


@pytest.mark.xfail(reason="a known failure is not a skip")
def test_known_failure():
    assert False
'''

MODULE_SKIP = '''
import pytest

transformers = pytest.importorskip("transformers")


def test_never_collected():
    pass
'''


def _run(tmp_path: Path, strict: bool) -> tuple[int, str, dict[str, str]]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_hf_module.py").write_text(MODULE_SKIP)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    env = {k: v for k, v in os.environ.items() if k != "SMP_TEST_STRICT_SKIPS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if strict:
        env["SMP_TEST_STRICT_SKIPS"] = "1"
    junit = tmp_path / f"junit-{strict}.xml"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-rA",
         f"--junitxml={junit}", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name", "")] = kinds[0] if kinds else "passed"
    return done.returncode, done.stdout + done.stderr, outcomes


def test_strict_mode_fails_skips_for_missing_dev_dependencies(tmp_path: Path) -> None:
    code, out, outcomes = _run(tmp_path, strict=True)
    assert code == 1, out
    assert outcomes["test_runs"] == "passed"
    assert outcomes["test_needs_transformers"] == "failure"
    assert outcomes["test_needs_mpiexec"] == "error"  # a skipif skips in setup: its failure is an error
    assert outcomes["test_unexplained"] == "failure"
    assert outcomes["test_transformer_engine"] == "skipped"  # registered: TE is not a dev dependency
    assert outcomes["test_known_failure"] == "skipped"  # junit's spelling of xfail: untouched
    import torch

    assert outcomes["test_on_gpu"] == ("passed" if torch.cuda.is_available() else "skipped")
    assert "transformers is pinned in requirements/dev.txt" in out
    assert "mpich is pinned in requirements/dev.txt" in out
    # The module skipped while collecting is named, and fails the run on its own too.
    assert "FAILED test_hf_module.py (every test in it)" in out


def test_a_module_skipped_while_collecting_fails_the_run_alone(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_hf_module.py").write_text(MODULE_SKIP)
    env = dict(os.environ, SMP_TEST_STRICT_SKIPS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 1, done.stdout  # not 5 (nothing ran) and not 0
    assert "FAILED test_hf_module.py (every test in it)" in done.stdout and "transformers is pinned" in done.stdout


def test_without_strict_mode_skips_stay_skips(tmp_path: Path) -> None:
    code, out, outcomes = _run(tmp_path, strict=False)
    assert code == 0, out
    assert outcomes["test_needs_transformers"] == "skipped" and outcomes["test_unexplained"] == "skipped"


def test_the_readme_test_command_is_strict() -> None:
    text = (ROOT / "scripts" / "test.sh").read_text()
    assert 'export SMP_TEST_STRICT_SKIPS="${SMP_TEST_STRICT_SKIPS:-1}"' in text
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_explanations_name_the_pinned_package() -> None:
    assert {"transformers", "mpich", "mpi4py", "torch"} <= set(pinned_packages())
    assert "transformers is pinned" in explain("could not import 'transformers': No module named 'transformers'")
    assert "mpich is pinned" in explain("mpiexec (mpich wheel) not installed")
    assert "register it in ALLOWED" in explain("the smp console script is not installed")
