"""Shared fixtures: every test starts and ends with a clean smp state."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _clean_smp_state() -> Iterator[None]:
    yield
    if "smp.torch" in sys.modules:
        from smp.torch import runtime

        runtime.reset()
    else:
        import smp.state

        smp.state.reset()
