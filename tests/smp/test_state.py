"""`smp.state.reset` drops every field and closes the failure channel and the frontend state (no framework)."""

from __future__ import annotations

from dataclasses import fields

import pytest

import smp.state as smp_state


class _Held:
    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def close(self) -> None:
        # What a close sees must already be the fresh state (the channel's exit mark, a context's undo).
        assert smp_state.current().failure is None and smp_state.current().frontend is None
        self.log.append(self.name)
        if self.fail:
            raise RuntimeError(f"{self.name} failed to close")


def test_reset_puts_every_field_back_and_closes_what_it_held() -> None:
    log: list[str] = []
    st = smp_state.current()
    smp_state.update(rank=3, framework="torch", model=object(), failure=_Held(log, "failure"),
                     frontend=_Held(log, "frontend"))
    smp_state.reset()
    assert smp_state.current() is st
    assert all(getattr(st, f.name) == f.default for f in fields(st))
    assert log == ["failure", "frontend"]


def test_a_failing_close_still_closes_the_rest_and_then_raises() -> None:
    log: list[str] = []
    smp_state.update(failure=_Held(log, "failure", fail=True), frontend=_Held(log, "frontend"))
    with pytest.raises(RuntimeError, match="failure failed to close"):
        smp_state.reset()
    assert log == ["failure", "frontend"]
    assert smp_state.current().failure is None and smp_state.current().frontend is None
