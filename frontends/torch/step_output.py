"""`StepOutput`, the per-microbatch results of an ``smp.step`` call, and `TorchStepOps` for the core.

A step function runs once per microbatch; each tensor it returns reaches the caller as a
`StepOutput` holding that tensor from every microbatch, in microbatch order
(``smp.torch.step.StepOutput`` in SMP v1). `TorchStepOps` implements the core's `smp.step.StepOps`
protocol, which splits arguments and aggregates return values (see `smp.step`).

Example::

    @smp.step
    def train_step(model, data, target):
        loss = F.nll_loss(model(data), target)
        model.backward(loss)
        return loss

    loss_mb = train_step(model, data, target)   # StepOutput([l0, l1, l2, l3])
    loss = loss_mb.reduce_mean()
"""

from __future__ import annotations

import argparse
import reprlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from smp.errors import StepOutputError

__all__ = ["StepOutput", "TorchStepOps"]


class StepOutput:
    """The values one return position of a step took in each microbatch.

    Attributes:
        outputs: the per-microbatch values, indexed by microbatch.

    Example:
        >>> out = StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
        >>> len(out), out[1].tolist()
        (2, [3.0, 4.0])
        >>> out.reduce_mean().tolist(), out.concat().tolist()
        ([2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    """

    def __init__(self, outputs: Iterable[Any] | None = None) -> None:
        self.outputs: list[Any] = list(outputs) if outputs is not None else []

    def __getitem__(self, index: int | slice) -> Any:
        """``outputs[index]``: the value of microbatch ``index`` (a list for a slice)."""
        return self.outputs[index]

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.outputs)

    def _require_outputs(self, what: str) -> None:
        if not self.outputs:
            raise StepOutputError(f"StepOutput.{what}() of an empty StepOutput: there is nothing to reduce. "
                                  f"Fix: check that the step ran at least one microbatch (microbatches >= 1)")

    def reduce_mean(self) -> Any:
        """``sum(outputs) / len(outputs)``: the batch value of a mean-reduced per-microbatch loss.

        Example:
            >>> StepOutput([torch.tensor(1.0), torch.tensor(2.0)]).reduce_mean()
            tensor(1.5000)
        """
        self._require_outputs("reduce_mean")
        return sum(self.outputs) / len(self.outputs)

    def reduce_sum(self) -> Any:
        """``sum(outputs)``.

        Example:
            >>> StepOutput([torch.tensor(1.0), torch.tensor(2.0)]).reduce_sum()
            tensor(3.)
        """
        self._require_outputs("reduce_sum")
        return sum(self.outputs)

    def concat(self) -> torch.Tensor:
        """``torch.cat(outputs, dim=0)``: the batch-sized tensor the unsplit step would have returned.

        0-dim tensors (per-microbatch scalars such as a loss) cannot be concatenated, so they are
        stacked instead into a 1-D tensor of length ``len(self)``. The dim is always 0, as in SMP v1;
        for another dim use ``torch.cat(out.outputs, dim=d)``.

        Example:
            >>> StepOutput([torch.zeros(2, 3), torch.ones(2, 3)]).concat().shape
            torch.Size([4, 3])
            >>> StepOutput([torch.tensor(1.0), torch.tensor(2.0)]).concat()
            tensor([1., 2.])
        """
        self._require_outputs("concat")
        if all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in self.outputs):
            return torch.stack(self.outputs)
        return torch.cat(self.outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """``torch.stack(outputs)``: a new leading dim indexed by microbatch.

        Example:
            >>> StepOutput([torch.zeros(2, 3), torch.ones(2, 3)]).stack().shape
            torch.Size([2, 2, 3])
        """
        self._require_outputs("stack")
        return torch.stack(self.outputs)

    def map(self, fn: Callable[[Any], Any]) -> StepOutput:
        """Apply ``fn`` to every microbatch's value, in place; returns ``self`` for chaining.

        Example:
            >>> StepOutput([torch.tensor(1.0), torch.tensor(2.0)]).map(lambda t: t * 10).outputs
            [tensor(10.), tensor(20.)]
        """
        self.outputs = [fn(o) for o in self.outputs]
        return self

    def process_outputs(self, fn: Callable[[Any], Any]) -> StepOutput:
        """A new StepOutput with ``fn`` applied to every microbatch's value; ``self`` is unchanged.

        Example:
            >>> out = StepOutput([torch.tensor(-1.0), torch.tensor(2.0)])
            >>> out.process_outputs(torch.abs).outputs, out.outputs
            ([tensor(1.), tensor(2.)], [tensor(-1.), tensor(2.)])
        """
        return StepOutput(fn(o) for o in self.outputs)

    def add_output(self, output: Any) -> None:
        """Append the value of the next microbatch."""
        self.outputs.append(output)

    def clear(self) -> None:
        """Remove every value."""
        self.outputs = []

    def __repr__(self) -> str:
        outs = self.outputs
        n = len(outs)
        if n and all(isinstance(o, torch.Tensor) for o in outs):
            first = outs[0]
            same = all(o.shape == first.shape and o.dtype == first.dtype and o.device == first.device
                       for o in outs)
            if same and first.numel() == 1:
                values = ", ".join(f"{o.item():.6g}" for o in outs[:8]) + (", ..." if n > 8 else "")
                return f"StepOutput({n} microbatches, {first.dtype} on {first.device}: [{values}])"
            if same:
                return (f"StepOutput({n} microbatches of {first.dtype} tensors of shape "
                        f"{tuple(first.shape)} on {first.device})")
        return f"StepOutput({n} microbatches: {reprlib.repr(outs)})"


# Passed whole into a step as a matter of course: no "passed unchanged" warning.
_QUIET_TYPES: tuple[type, ...] = (
    torch.nn.Module,
    torch.optim.Optimizer,
    torch.optim.lr_scheduler.LRScheduler,
    torch.optim.lr_scheduler.ReduceLROnPlateau,
    torch.amp.GradScaler,
    argparse.Namespace,
    torch.device,
    torch.dtype,
    torch.Generator,
)


class TorchStepOps:
    """The core's `smp.step.StepOps` for torch: tensors are ``torch.Tensor``, StepOutputs `StepOutput`.

    Args:
        extra_quiet_types: more types passed whole without a warning (e.g. an optimizer wrapper
            that is not a ``torch.optim.Optimizer``).

    Example:
        >>> ops = TorchStepOps()
        >>> ops.narrow(torch.arange(6), 0, 2, 2).tolist(), ops.quiet(torch.nn.Linear(1, 1))
        ([2, 3], True)
    """

    def __init__(self, extra_quiet_types: tuple[type, ...] = ()) -> None:
        self.quiet_types = _QUIET_TYPES + tuple(extra_quiet_types)

    def is_tensor(self, x: object) -> bool:
        return isinstance(x, torch.Tensor)

    def narrow(self, tensor: Any, dim: int, start: int, length: int) -> Any:
        return tensor.narrow(dim, start, length)

    def dim_size(self, tensor: Any, dim: int) -> int:
        return int(tensor.size(dim))

    def is_step_output(self, x: object) -> bool:
        return isinstance(x, StepOutput)

    def quiet(self, x: object) -> bool:
        return isinstance(x, self.quiet_types)

    def probable_bug(self, x: object) -> str | None:
        if isinstance(x, self.quiet_types):
            return None
        if isinstance(x, (DataLoader, Dataset, Sampler)):
            return (f"a {type(x).__name__} is not split into microbatches, and iterating it inside the step "
                    f"would run once per microbatch. Fix: draw the batch outside the step and pass its "
                    f"tensors (SMP splits tensors).")
        if isinstance(x, Iterator):
            return ("an iterator passed into a step is shared by every microbatch. Fix: call next() outside "
                    "the step and pass the batch's tensors.")
        if hasattr(x, "param_groups") and callable(getattr(x, "step", None)):
            return ("it looks like an optimizer; the step body runs once per microbatch, so calling its step() "
                    "inside would update the parameters num_microbatches times. Fix: call optimizer.step() "
                    "after the step function returns (or register the wrapper type as quiet).")
        return None
