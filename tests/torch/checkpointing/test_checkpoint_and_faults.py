"""save_checkpoint / kill / resume_from_checkpoint continues with the same losses; failures end all ranks."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch import zoo

CFG = {"pipeline_parallel_degree": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
       "comm_timeout": 60.0}


def _setup(kind: str = "gpt") -> tuple[Any, Any, Any, Any]:
    import smp.torch as smp

    smp.init(CFG)
    net = zoo.build(kind)
    model = smp.DistributedModel(net)
    net.place(2, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    train_step = zoo.train_step(kind)

    return smp, model, opt, train_step


def _train(steps: range, smp: Any, model: Any, opt: Any, train_step: Any) -> list[float]:
    data = zoo.batches("gpt", 6)
    return zoo.train_losses(model, opt, train_step, [data[i] for i in steps])


def _uninterrupted() -> list[float]:
    return _train(range(6), *_setup())


def _save_then_crash(path: str) -> list[float]:
    smp, model, opt, step = _setup()
    losses = _train(range(3), smp, model, opt, step)
    smp.save_checkpoint(path, "step3", model=model, optimizer=opt, user_content={"step": 3})
    losses += _train(range(3, 4), smp, model, opt, step)
    if smp.rank() == 1:
        from smp.torch.checkpointing import files

        def crash(*_: Any, **__: Any) -> None:
            os._exit(17)  # the process dies in the middle of writing tag step4

        files.write_partial_checkpoint = crash  # type: ignore[assignment]
    smp.save_checkpoint(path, "step4", model=model, optimizer=opt, user_content={"step": 4})
    return losses


def _resume(path: str) -> tuple[Any, list[float]]:
    import smp.torch as smp

    smp.init(CFG)
    content = smp.resume_from_checkpoint(path)  # before the model exists: applied after partitioning
    _, model, opt, step = _setup_after_init()
    return content, _train(range(3, 6), smp, model, opt, step)


def _setup_after_init() -> tuple[Any, Any, Any, Any]:
    import smp.torch as smp

    net = zoo.build("gpt")
    model = smp.DistributedModel(net)
    net.place(2, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    train_step = zoo.train_step("gpt")

    return smp, model, opt, train_step


def test_crash_during_save_then_resume_gives_the_same_losses(tmp_path: Any) -> None:
    reference = run_ranks(_uninterrupted, 2, timeout=120)[0]
    path = str(tmp_path / "ckpt")
    crashed = run_ranks(_save_then_crash, 2, args=(path,), timeout=120, expect_failure=True)
    assert crashed[1] == ("died", 17), crashed  # rank 1 died mid-save; rank 0 saw its peer vanish
    assert crashed[0][0] == "error"
    assert open(os.path.join(path, "newest")).read().split() == ["step3"]
    content, losses = run_ranks(_resume, 2, args=(path,), timeout=120)[0]
    assert content == {"step": 3}
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[3:]), rtol=1e-6, atol=1e-7)


class Boom(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom inside a module on rank 1")


def _fault() -> str:
    import smp.torch as smp

    smp.init(CFG)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Boom())
    model = smp.DistributedModel(net)
    smp.set_partition(net[1], 1)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        model.backward(out)
        return out

    start = time.monotonic()
    try:
        train_step(model, torch.randn(8, 4))
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return f"{type(e).__name__} after {time.monotonic() - start:.1f}s: {e}"
    return "no error"


def test_an_exception_on_rank_1_ends_every_rank_with_that_error() -> None:
    res = run_ranks(_fault, 2, timeout=60)
    for text in res:
        assert "boom inside a module on rank 1" in text, res
        assert float(text.split(" after ")[1].split("s:")[0]) < 30
    assert res[0].startswith("RemoteRankError")
    assert re.search(r"rank 1 \(pp_rank .*; pid \d+ on host .+\) failed", res[0]), res[0]


@pytest.mark.parametrize("bad", ["forward", "backward"])
def test_guards_outside_a_step(bad: str) -> None:
    res = run_ranks(_guard, 2, args=(bad,), timeout=60)
    assert all("NotInStepFnError" in r for r in res), res


def _guard(bad: str) -> str:
    import smp.torch as smp

    smp.init(CFG)
    model = smp.DistributedModel(torch.nn.Linear(2, 2))
    try:
        if bad == "forward":
            model(torch.randn(2, 2))
        else:
            model.backward(torch.randn(2, requires_grad=True).sum())
    except Exception as e:  # noqa: BLE001
        return type(e).__name__
    return "no error"
