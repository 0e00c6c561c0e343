"""What the rest of the frontend may use of `DistributedModel` besides its public (SMP v1) methods.

``@smp.step`` (`smp.torch.step`) drives a step through `StepModel`; checkpoints
(`smp.torch.checkpointing.saving`) read and restore the partition through `CheckpointModel`. Anything not
declared here is the model's own business: the rooms beside this file (`dispatch`,
`data_parallel`, `state_dict`) are reached only through the model, and `state_dict` sees it only
as a `LocalView`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..engine.engine import Engine

__all__ = ["CheckpointModel", "LocalView", "RecordedStep", "StepModel"]


@dataclass
class RecordedStep:
    """What the first (recording) run of one step function measured, for its later static plans.

    Attributes:
        chain: the pp_ranks one microbatch visits, in order (``[0]`` when it never left the leader).
        backward: whether the step body called ``model.backward``.
        costs: per-segment durations measured on every pipeline rank (`smp.pipeline.choose`).
        static: whether the shared scheduler can plan it: its backward visits the chain's ranks in
            reverse (not so when some cross-rank calls get no gradient, e.g. under ``torch.no_grad()``).
        seconds: the recording step's wall time (its microbatches ran one at a time).
        planned: steps run on a static plan so far (the costs are measured again once, see step.py).
        plan: this rank's plan for the current costs (built once, not on every step), or the
            error that stopped it.
        schedule: the schedule of that plan (the config's ``pipeline``, or the one smp picked).
    """

    chain: list[int]
    backward: bool
    costs: Any
    static: bool = True
    seconds: float = 0.0
    planned: int = 0
    plan: Any = None
    schedule: str = ""


class StepModel(Protocol):
    """The model as ``@smp.step`` sees it."""

    plans: dict[Any, RecordedStep]  # one entry per step function, filled by its first run
    last_timeline: list[Any]  # the engine events of the last step (`step_timeline` draws them)

    @property
    def in_step(self) -> bool: ...

    @property
    def pp_rank(self) -> int: ...

    @property
    def engine(self) -> Engine | None:
        """The pipeline engine; None at pipeline_parallel_degree == 1 (microbatches run in turn)."""

    def step_scope(self, first_microbatch: Callable[[], Any]) -> AbstractContextManager[None]:
        """Inside a step: partitions on the first step (tracing ``first_microbatch`` if it must)."""

    def after_step(self) -> None:
        """Once the microbatches are done: gradients synchronised, post-step hooks run."""


class CheckpointModel(Protocol):
    """The model as checkpoint saving and loading see it."""

    @property
    def partitioned(self) -> bool: ...

    @property
    def partition_assignment(self) -> dict[str, int]:
        """Module path -> pp_rank, as decided on the first step (saved with partial checkpoints)."""

    def use_saved_partition(self, assignment: dict[str, int]) -> None:
        """Partition as a checkpoint was saved (before the first step; an error after it if different)."""


class LocalView(Protocol):
    """The wrapped module and what this rank holds of it (what `state_dict` reads)."""

    module: nn.Module
    cfg: Any

    @property
    def partitioned(self) -> bool: ...

    def local_parameters(self) -> Iterator[nn.Parameter]: ...

    def local_buffers(self) -> Iterator[torch.Tensor]: ...
