"""StepOutput and TorchStepOps: the step core run on real torch tensors, modules and data loaders."""

from __future__ import annotations

import argparse
import doctest
import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp.torch import step_output
from smp.torch.step_output import StepOutput, TorchStepOps
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import smp.step
from smp.errors import StepOutputError, TensorSplitError
from smp.step import StepSpec, aggregate_outputs, split_arguments

OPS = TorchStepOps()


def run_step(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, n: int = 4,
             **options: Any) -> Any:
    """What the step engine does on one process: split, run once per microbatch, aggregate."""
    spec = StepSpec.from_function(func, **options)
    parts = split_arguments(spec, args, kwargs or {}, n, OPS)
    return aggregate_outputs([func(*a, **k) for a, k in parts], OPS, StepOutput)


# ----------------------------------------------------------------------------------------------
# StepOutput


def outs() -> StepOutput:
    return StepOutput([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 1.0])])


def test_container_protocol() -> None:
    o = outs()
    assert len(o) == 3 and o[1].tolist() == [3.0, 6.0] and o[-1] is o.outputs[-1]
    assert [t.tolist() for t in o] == [t.tolist() for t in o.outputs]
    assert o[0:2] == o.outputs[0:2]
    assert StepOutput().outputs == [] and len(StepOutput()) == 0
    assert StepOutput(t for t in [torch.tensor(1.0)]).outputs[0].item() == 1.0


def test_reductions() -> None:
    o = outs()
    torch.testing.assert_close(o.reduce_sum(), torch.tensor([9.0, 9.0]))
    torch.testing.assert_close(o.reduce_mean(), torch.tensor([3.0, 3.0]))
    torch.testing.assert_close(o.concat(), torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0, 1.0]))
    torch.testing.assert_close(o.stack(), torch.tensor([[1.0, 2.0], [3.0, 6.0], [5.0, 1.0]]))
    # sum/len is true division, as in SMP v1: integer losses average to a float
    ints = StepOutput([torch.tensor(1), torch.tensor(2)])
    assert ints.reduce_mean().item() == 1.5 and ints.reduce_sum().dtype == torch.int64
    # plain Python numbers work too (e.g. loss.item() collected by hand)
    assert StepOutput([1.0, 2.0, 6.0]).reduce_mean() == 3.0


def test_concat_of_scalars_stacks_them() -> None:
    o = StepOutput([torch.tensor(0.5), torch.tensor(0.25)])
    torch.testing.assert_close(o.concat(), torch.tensor([0.5, 0.25]))


def test_concat_is_along_dim_0() -> None:
    o = StepOutput([torch.zeros(2, 3), torch.ones(2, 3)])
    assert o.concat().shape == (4, 3)
    assert torch.equal(o.concat()[2:], torch.ones(2, 3))


@pytest.mark.parametrize("method", ["reduce_mean", "reduce_sum", "concat", "stack"])
def test_reducing_nothing_is_an_error(method: str) -> None:
    with pytest.raises(StepOutputError, match=rf"StepOutput.{method}\(\) of an empty StepOutput"):
        getattr(StepOutput(), method)()


def test_map_is_in_place_and_process_outputs_is_not() -> None:
    o = outs()
    original = list(o.outputs)
    p = o.process_outputs(lambda t: t * 2)
    assert p is not o and o.outputs == original
    torch.testing.assert_close(p.concat(), original_concat(original) * 2)
    assert o.map(lambda t: t + 1) is o
    torch.testing.assert_close(o.concat(), original_concat(original) + 1)


def original_concat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts)


def test_add_output_and_clear() -> None:
    o = StepOutput()
    o.add_output(torch.tensor(1.0))
    o.add_output(torch.tensor(2.0))
    assert len(o) == 2 and o.reduce_sum().item() == 3.0
    o.clear()
    assert len(o) == 0


def test_repr() -> None:
    assert repr(StepOutput([torch.tensor(0.5), torch.tensor(0.25)])) == \
        "StepOutput(2 microbatches, torch.float32 on cpu: [0.5, 0.25])"
    assert repr(StepOutput([torch.zeros(16, 10)] * 4)) == \
        "StepOutput(4 microbatches of torch.float32 tensors of shape (16, 10) on cpu)"
    assert repr(StepOutput([1, "a"])) == "StepOutput(2 microbatches: [1, 'a'])"
    assert repr(StepOutput()) == "StepOutput(0 microbatches: [])"
    many = repr(StepOutput([torch.tensor(float(i)) for i in range(10)]))
    assert many.endswith("[0, 1, 2, 3, 4, 5, 6, 7, ...])")


# ----------------------------------------------------------------------------------------------
# TorchStepOps


def test_quiet_types() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    quiet = [model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
             torch.amp.GradScaler("cpu"), argparse.Namespace(lr=1), torch.device("cpu"), torch.float16,
             torch.Generator()]
    for x in quiet:
        assert OPS.quiet(x), x
        assert OPS.probable_bug(x) is None, x
    assert not OPS.quiet(torch.zeros(1)) and not OPS.quiet(object())


def test_extra_quiet_types() -> None:
    class Wrapper:
        param_groups: list[Any] = []

        def step(self) -> None: ...

    assert "looks like an optimizer" in (OPS.probable_bug(Wrapper()) or "")
    ops = TorchStepOps(extra_quiet_types=(Wrapper,))
    assert ops.quiet(Wrapper()) and ops.probable_bug(Wrapper()) is None


def test_probable_bugs() -> None:
    ds = TensorDataset(torch.arange(8))
    for x in [ds, DataLoader(ds, batch_size=2), RandomSampler(ds)]:
        assert "draw the batch outside the step" in (OPS.probable_bug(x) or ""), x
    assert "call next() outside" in (OPS.probable_bug(iter([1])) or "")
    assert OPS.probable_bug(object()) is None


def test_tensor_operations() -> None:
    t = torch.arange(12).reshape(3, 4)
    assert OPS.is_tensor(t) and not OPS.is_tensor([1])
    assert OPS.dim_size(t, 1) == 4 and OPS.dim_size(t, -2) == 3
    part = OPS.narrow(t, 1, 2, 2)
    assert part.tolist() == [[2, 3], [6, 7], [10, 11]]
    assert part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view, no copy
    assert OPS.is_step_output(StepOutput()) and not OPS.is_step_output([torch.zeros(1)])


def test_docstring_examples() -> None:
    for module in (smp.step, step_output):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ----------------------------------------------------------------------------------------------
# The core on torch: split a real batch, run a real model per microbatch, reassemble


def test_split_batch_dict_and_concat_gives_back_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (8, 5), generator=g), "labels": torch.randint(0, 3, (8,), generator=g),
             "meta": {"mask": torch.ones(8, 5, dtype=torch.bool)}}

    def echo(batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    out = run_step(echo, (batch,))
    assert isinstance(out["input_ids"], StepOutput) and len(out["input_ids"]) == 4
    assert all(t.shape == (2, 5) for t in out["input_ids"])
    assert torch.equal(out["input_ids"].concat(), batch["input_ids"])
    assert torch.equal(out["labels"].concat(), batch["labels"])
    assert torch.equal(out["meta"]["mask"].concat(), batch["meta"]["mask"])


def test_microbatched_model_matches_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data, target = torch.randn(12, 6), torch.randint(0, 3, (12,))

    def train_step(model: torch.nn.Module, data: torch.Tensor, target: torch.Tensor) -> Any:
        logits = model(data)
        loss = F.cross_entropy(logits, target)
        return logits, loss, loss.item()

    logits_mb, loss_mb, loss_items = run_step(train_step, (model, data, target), n=3)
    full_logits = model(data)
    torch.testing.assert_close(logits_mb.concat(), full_logits)
    torch.testing.assert_close(loss_mb.reduce_mean(), F.cross_entropy(full_logits, target))
    assert isinstance(loss_items, list) and len(loss_items) == 3
    assert sum(loss_items) / 3 == pytest.approx(loss_mb.reduce_mean().item())


def test_sequence_first_axis_and_non_split_inputs() -> None:
    seq_first = torch.randn(7, 4, 2)  # (seq, batch, hidden): split along axis 1
    bias = torch.randn(2)

    def f(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        assert bias.shape == (2,)
        return (x + bias).transpose(0, 1)

    out = run_step(f, (seq_first, bias), n=2, input_split_axes={"x": 1}, non_split_inputs=["bias"])
    torch.testing.assert_close(out.concat(), (seq_first + bias).transpose(0, 1))


def test_step_output_feeds_the_next_step() -> None:
    x = torch.arange(8.0).reshape(8, 1)

    def first(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def second(h: Any, scale: float) -> torch.Tensor:
        return h + scale

    hidden = run_step(first, (x,))
    out = run_step(second, (hidden, 1.0), non_split_inputs=["h"])
    torch.testing.assert_close(out.concat(), x * 2 + 1)


def test_structseq_outputs_keep_their_type() -> None:
    x = torch.randn(4, 3)

    def f(x: torch.Tensor) -> Any:
        return torch.max(x, dim=1)

    out = run_step(f, (x,), n=2)
    assert type(out) is type(torch.max(x, dim=1))
    torch.testing.assert_close(out.values.concat(), torch.max(x, dim=1).values)
    torch.testing.assert_close(out.indices.concat(), torch.max(x, dim=1).indices)


def test_indivisible_batch_error_names_argument_and_fix() -> None:
    def f(model: torch.nn.Module, data: torch.Tensor) -> torch.Tensor:
        return data

    with pytest.raises(TensorSplitError, match=r"argument data into 4 microbatches: its size along axis 0 is 10, "
                                               r"which is not divisible by 4.*drop_last=True"):
        run_step(f, (torch.nn.Linear(1, 1), torch.zeros(10, 1)))


def test_models_pass_quietly_and_data_loaders_warn(caplog: pytest.LogCaptureFixture) -> None:
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4)

    def f(model: torch.nn.Module, opt: Any, loader: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    model = torch.nn.Linear(1, 1)
    with caplog.at_level(logging.WARNING, logger="smp.step"):
        run_step(f, (model, torch.optim.SGD(model.parameters(), lr=0.1), loader, torch.zeros(4)))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "argument 'loader' is a DataLoader" in warnings[0] and "probably a bug" in warnings[0]
