"""Shared fixtures and hooks: every test starts and ends with a clean smp state; strict skips."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tests measure: the automatic partition traces in every launch unless a test turns the records of
# traced costs on with a directory of its own (frontends/torch/partitioning/record.py).
os.environ.setdefault("SMP_PARTITION_CACHE", "off")

# Strict skips (SMP_TEST_STRICT_SKIPS=1, set by scripts/test.sh and so by CI): a skip for a missing
# dependency that requirements/dev.txt provides fails the run; see tests/helpers/strict_skips.py.
from tests.helpers.strict_skips import (  # noqa: E402,F401 - hooks, found by name
    pytest_collection_modifyitems,
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


@pytest.fixture(autouse=True)
def _clean_smp_state() -> Iterator[None]:
    yield
    import smp.state

    if "smp.tensorflow" in sys.modules and smp.state.current().framework == "tensorflow":
        from smp.tensorflow.runtime.init import reset as tf_reset

        tf_reset()  # frees the MPI communicators too
    elif "smp.torch" in sys.modules:
        from smp.torch.runtime.init import reset

        reset()
    else:
        smp.state.reset()
