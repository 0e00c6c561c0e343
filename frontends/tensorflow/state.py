"""smp.tensorflow's per-process state: what the step, the model and the engine share.

It lives in ``smp.state.current().frontend`` (so ``smp.reset()`` closes it) and is made on first
use by `tf_state()`. The fields are the contract between the rooms:

- ``microbatch``: set by ``smp.step`` while it traces the step body for microbatch ``m`` (0-based),
  None outside a step; ``DistributedModel.__call__`` raises outside a step and reads it to name
  the messages of that microbatch.
- ``num_microbatches``: the microbatches of the step being traced.
- ``step_traces``: how many step bodies were traced so far (all microbatches of one trace count
  once); the engine folds it into message tags so two traced steps never mix.
- ``finish_step``: callbacks the engine registers; ``smp.step`` calls each with the flat list of
  the traced step's output tensors after the last microbatch and uses what they return instead
  (the engine makes the outputs wait for its pending sends there).
- ``close_hooks``: what `close` (``smp.reset()``) runs: patches undone, threads stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import smp.state as smp_state


@dataclass
class TFState:
    microbatch: int | None = None
    num_microbatches: int = 1
    step_traces: int = 0
    model: Any = None
    finish_step: list[Callable[[list[Any]], list[Any]]] = field(default_factory=list)
    close_hooks: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        hooks, self.close_hooks = self.close_hooks, []
        for hook in reversed(hooks):
            hook()


def tf_state() -> TFState:
    """This process's `TFState`, made on first use."""
    state = smp_state.current()
    if not isinstance(state.frontend, TFState):
        state.frontend = TFState()
    return state.frontend
