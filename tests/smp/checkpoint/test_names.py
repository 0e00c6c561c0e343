"""smp.checkpoint.names: the docstring examples (the names themselves are tested in
tests/torch/checkpointing/test_checkpoint_files.py)."""

from __future__ import annotations

import doctest
import tempfile
from pathlib import Path

import pytest

from smp.checkpoint import names


def test_docstring_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # find_partial's example writes under mkdtemp()
    result = doctest.testmod(names)
    assert result.attempted > 0 and result.failed == 0
