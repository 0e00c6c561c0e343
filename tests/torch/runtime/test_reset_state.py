"""``smp.reset()`` drops all process state: nothing a script set before a reset reaches the next model.

The state is `TorchState` on the core state (``smp.state.current().frontend``), plus the failure
channel; what a reset keeps on purpose is ``process_state.KEPT`` (Note [re-init]). Each test sets
every kind of state, resets, and checks the next model (or the next state) sees none of it.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

from tests.helpers.spawn import run_ranks
from tests.torch import zoo


def _patchable() -> list[object]:
    """The attributes that open smp contexts replace: nn.Module's and each TP-registered class's."""
    from smp.torch.tp.registry import all_registrations

    return [vars(nn.Module)["__init__"], vars(nn.Module)["register_parameter"],
            *[vars(cls).get("__init__") for cls in all_registrations()]]


def _set(ts: object) -> list[str]:
    """The fields of a `TorchState` that hold something (the lock always does, so it is left out)."""
    from smp.torch.runtime.process_state import TorchState

    return [f.name for f in fields(TorchState) if f.name != "lock" and getattr(ts, f.name)]


def test_smp_state_reset_leaves_a_fresh_torch_state_and_undoes_open_contexts() -> None:
    import smp.torch as smp
    from smp.torch.model.offload import Offloader
    from smp.torch.nn import seed_tensor_parallel
    from smp.torch.runtime import failure
    from smp.torch.runtime.process_state import TorchState, torch_state

    import smp.state as smp_state

    originals = _patchable()
    old = torch_state()
    left_open = ExitStack()
    left_open.enter_context(smp.partition(0))
    left_open.enter_context(smp.delay_param_initialization())
    left_open.enter_context(smp.tensor_parallelism())
    made = nn.Linear(2, 2)  # recorded by all three
    smp.set_partition(made, 0)
    old.pending["model"] = ({}, True)  # what resume_from_checkpoint leaves when no model exists yet
    seed_tensor_parallel(1234)
    old.offloader = Offloader(4, None)  # what the first checkpointed call makes under offload_activations
    channel = failure.FailureChannel(None, 0, 1.0)
    failure.set_channel(channel)
    before = sys.excepthook
    channel.install_excepthook()
    # Every field holds something, so a kind of state added to TorchState is covered here too.
    assert _set(old) == [f.name for f in fields(TorchState) if f.name != "lock"]
    assert made.weight.is_meta and _patchable() != originals

    smp_state.reset()  # the core reset alone: smp.reset() runs it after tearing down the groups

    assert smp_state.current().frontend is None and failure.channel() is None
    assert sys.excepthook is before  # the channel was closed
    assert _patchable() == originals  # the open contexts' patches are undone
    new = torch_state()
    assert new is not old and _set(new) == []
    with smp.partition(0):
        left_open.close()  # leaving the old contexts now touches only the old, detached state
        inner = nn.Linear(2, 2)
    assert new.created.get(inner) == 0 and made not in new.created and not inner.weight.is_meta
    assert _set(new) == ["created"] and _patchable() == originals


def test_nothing_set_before_a_reset_reaches_the_next_model(tmp_path: Path) -> None:
    """A resumed checkpoint nobody took, open contexts, a TP seed and a pending post-step hook, then
    ``smp.reset()``: the next model trains exactly like a fresh single-process reference."""
    import smp.torch as smp
    from smp.torch.nn import seed_tensor_parallel
    from smp.torch.nn.rng import tp_rng, tp_seed_offset
    from smp.torch.tp.marking import is_marked

    smp.init({"microbatches": 2})
    first = smp.DistributedModel(zoo.build("mlp"))
    opt = smp.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1, momentum=0.9))
    zoo.train_losses(first, opt, zoo.train_step("mlp"), zoo.batches("mlp", 2))
    smp.save_checkpoint(str(tmp_path), "trained")
    ran: list[str] = []
    first.register_post_step_hook(lambda *_: ran.append("hook"))  # would run after the next step of first
    smp.reset()

    smp.init({"microbatches": 2})
    smp.resume_from_checkpoint(str(tmp_path), "trained")  # no model yet: kept for the next one
    seed_tensor_parallel(1234)
    left_open = ExitStack()
    left_open.enter_context(smp.partition(0))
    left_open.enter_context(smp.delay_param_initialization())
    left_open.enter_context(smp.tensor_parallelism())
    smp.reset()

    smp.init({"microbatches": 2, "random_seed": 7})
    net = zoo.build("mlp")
    assert not any(p.is_meta for p in net.parameters()) and not any(is_marked(m) for m in net.modules())
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = zoo.train_losses(model, opt, zoo.train_step("mlp"), zoo.batches("mlp", 2))
    ref, _ = zoo.reference("mlp", steps=2)
    # Neither the resumed weights nor the resumed momentum reached the new model.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
    assert ran == []
    with tp_rng():  # seeded from the new config on first use, not the 1234 of before the reset
        drawn = torch.rand(3)
    assert torch.equal(drawn, torch.rand(3, generator=torch.Generator().manual_seed(tp_seed_offset(7, 0))))
    left_open.close()


def _placement_after_reset() -> tuple[list[str], list[float]]:
    import smp.torch as smp

    config = {"pipeline_parallel_degree": 2, "auto_partition": False, "default_partition": 0}
    smp.init(config)
    first_layer = zoo.build("mlp").net[0]  # the same weights as a fresh build's first layer
    smp.set_partition(first_layer, 1)
    left_open = ExitStack()
    left_open.enter_context(smp.partition(1))
    smp.reset()

    smp.init(config)
    net = zoo.build("mlp")  # created after the reset: the open smp.partition(1) no longer counts
    net.net[0] = first_layer  # placed before the reset: that set_partition no longer counts
    model = smp.DistributedModel(net)
    smp.set_partition(net.net[8], 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = zoo.train_losses(model, opt, zoo.train_step("mlp"), zoo.batches("mlp", 2))
    left_open.close()
    return sorted(name for name, _ in model.local_named_parameters()), losses


def test_partition_scopes_and_set_partition_before_a_reset_do_not_place_the_next_model() -> None:
    ref, _ = zoo.reference("mlp", steps=2)
    (on_0, losses_0), (on_1, losses_1) = run_ranks(_placement_after_reset, 2, timeout=90)
    assert on_1 == ["net.8.bias", "net.8.weight"]
    assert on_0 == sorted(f"net.{i}.{p}" for i in (0, 2, 4, 6) for p in ("bias", "weight"))
    for losses in (losses_0, losses_1):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
