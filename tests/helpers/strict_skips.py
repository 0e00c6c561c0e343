"""Strict skips: in the README's test environment a test may skip only for a registered reason.

``scripts/test.sh`` (and so CI) sets ``SMP_TEST_STRICT_SKIPS=1``. There, requirements/dev.txt
provides every dependency, so a skip such as ``could not import 'transformers'`` means the
environment is broken and about 65 TP/HF tests did not run: such a test is reported as failed
(a skip raised while collecting a module fails the run at its end, with the module named). Only the
skips in `ALLOWED` stay skips, each with the environment fact that makes it legitimate. Outside
strict mode (a developer's partial venv) every skip stays a skip.

Example (what a broken venv prints under ``bash scripts/test.sh``)::

    FAILED tests/torch/tp/test_tp_marking.py::test_hf_marking - skipped in the README's test
    environment: could not import 'transformers': transformers is pinned in requirements/dev.txt ...
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

ENV = "SMP_TEST_STRICT_SKIPS"
DEV_REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "requirements", "dev.txt")
# Commands a pinned package provides, which skip reasons name instead of the package.
PROVIDES = {"mpich": ("mpiexec", "mpirun"), "mpi4py": ("mpi4py",), "tensorflow-cpu": ("tensorflow", "keras")}


def _no_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


@dataclass(frozen=True)
class AllowedSkip:
    """A skip that is legitimate in the README's test environment.

    Attributes:
        why: shown nowhere but here: the reason this skip is fine.
        marker: the test carries this marker (None: any test).
        reason: a regular expression the skip reason must match (None: any reason).
        applies: the environment fact that must hold now, e.g. no CUDA device.
    """

    why: str
    marker: str | None = None
    reason: str | None = None
    applies: Callable[[], bool] = lambda: True

    def allows(self, markers: set[str], reason: str) -> bool:
        return ((self.marker is None or self.marker in markers)
                and (self.reason is None or re.search(self.reason, reason, re.IGNORECASE) is not None)
                and self.applies())


ALLOWED: tuple[AllowedSkip, ...] = (
    AllowedSkip("the CPU test machines have no CUDA device; tests/gpu/run.sh runs these on a GPU",
                marker="gpu", applies=_no_cuda),
    AllowedSkip("Transformer Engine needs CUDA and is not in requirements/dev.txt",
                reason=r"transformer[_ ]engine", applies=lambda: not _importable("transformer_engine")),
)


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def strict() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def pinned_packages(path: str = DEV_REQUIREMENTS) -> list[str]:
    """Package names pinned in requirements/dev.txt (``name==version`` lines)."""
    names = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(re.split(r"[=<>!~\[; ]", line, maxsplit=1)[0].lower())
    return names


def explain(reason: str) -> str:
    """Why a skip is not accepted, naming the pinned package it points at when there is one."""
    for name in pinned_packages():
        words = (name, name.replace("-", "_"), *PROVIDES.get(name, ()))
        if any(re.search(rf"\b{re.escape(w)}\b", reason, re.IGNORECASE) for w in words):
            return (f"skipped in the README's test environment: {reason}: {name} is pinned in "
                    "requirements/dev.txt, so the venv is broken. Fix: `bash scripts/test.sh` rebuilds it "
                    "(or `.venv/bin/pip install -r requirements/dev.txt`)")
    return (f"skipped in the README's test environment: {reason}. Fix: make the test run there, or, if the "
            f"skip is legitimate on every CI machine, register it in ALLOWED in {__name__}")


def _reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _allowed(markers: set[str], reason: str) -> bool:
    return any(rule.allows(markers, reason) for rule in ALLOWED)


_collect_failures: list[tuple[str, str]] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The gpu marker's promise ("skipped when none is present"), kept here beside the rule allowing it.
    if _no_cuda():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (marked gpu)"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if not (strict() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _reason(report.longrepr)
    if _allowed({m.name for m in item.iter_markers()}, reason):
        return
    report.outcome = "failed"
    report.longrepr = explain(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    outcome = yield
    report = outcome.get_result()
    if strict() and report.skipped:
        reason = _reason(report.longrepr)
        if not _allowed({m.name for m in collector.iter_markers()}, reason):
            # Kept a skip while collecting (turning it into an error would stop the session
            # before any test ran); the session fails at its end instead.
            _collect_failures.append((report.nodeid, explain(reason)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _collect_failures and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _collect_failures:
        terminalreporter.section(f"skips not allowed in the README's test environment ({ENV}=1)", red=True)
        for nodeid, why in _collect_failures:
            terminalreporter.line(f"FAILED {nodeid} (every test in it) - {why}", red=True)
