"""smp.runtime.flags: the one reading of boolean environment variables."""

from __future__ import annotations

import doctest

import pytest

from smp.errors import LaunchError
from smp.runtime import flags
from smp.runtime.flags import env_flag


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_on_values(value: str) -> None:
    assert env_flag("SMP_X", env={"SMP_X": value}) is True


@pytest.mark.parametrize("value", ["0", "False", "no", "OFF"])
def test_off_values(value: str) -> None:
    assert env_flag("SMP_X", env={"SMP_X": value}) is False


@pytest.mark.parametrize("env", [{}, {"SMP_X": ""}, {"SMP_X": "  "}])
def test_unset_or_empty_is_not_given(env: dict[str, str]) -> None:
    assert env_flag("SMP_X", env=env) is None


def test_other_values_name_the_variable_and_the_fix() -> None:
    with pytest.raises(LaunchError, match=r"SMP_X='maybe' is not understood\. Fix: SMP_X=1 or SMP_X=0 .*; 1 turns X on"):
        env_flag("SMP_X", "1 turns X on", env={"SMP_X": "maybe"})


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SMP_X", "yes")
    assert env_flag("SMP_X") is True


def test_docstring_example() -> None:
    result = doctest.testmod(flags)
    assert result.attempted > 0 and result.failed == 0
