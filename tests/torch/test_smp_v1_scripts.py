"""SMP v1-style scripts run unchanged apart from the import: the pt_mnist.py shape under torchrun,
and the SMP v1 checkpointing helpers (`smp.checkpoint`, `checkpoint_sequential`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import torch
from torch import nn

from tests.helpers.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pt_mnist_shape_trains_on_four_ranks(tmp_path: Any) -> None:
    """2 partitions x 2 data-parallel replicas, spread placement, GradScaler, Adadelta, StepLR,
    list outputs of an evaluation step, and partial smp.save on dp_rank 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "4",
           "examples/mnist_smp_v1.py", "--epochs", "1", "--samples", "512", "--save", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    m = re.search(r"train loss [\d.]+ \(first ([\d.]+), last ([\d.]+)\).*accuracy ([\d.]+)", proc.stdout)
    assert m, proc.stdout
    first, last, accuracy = (float(g) for g in m.groups())
    assert last < first / 2 and accuracy > 0.5, proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["mnist_checkpoint_0_0.pt", "mnist_checkpoint_1_0.pt"]
    saved = torch.load(tmp_path / "mnist_checkpoint_1_0.pt", weights_only=False)
    assert saved["model_state_dict"]["_smp_is_partial"] is True


def test_tensor_parallel_hf_script_trains_checkpoints_and_exports(tmp_path: Any) -> None:
    """examples/tp_hf_smp_v1.py: an HF Llama marked with smp.tensor_parallelism(), tp=2 x pp=2, SMP v1's
    default per-rank batches, automatic partition; the Hugging Face export loads in plain transformers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc-per-node", "4",
           "examples/tp_hf_smp_v1.py", "--steps", "12", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", proc.stdout)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, proc.stdout
    assert os.path.isdir(tmp_path / "checkpoint")
    import transformers

    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ids = (torch.arange(32) + 7).remainder(256)[None]
    with torch.no_grad():
        loss = plain(input_ids=ids, labels=ids).loss.item()
    assert loss < losses[0] - 0.5, "the exported model holds the trained weights"


def _checkpoint_grads(strategy: str | None) -> dict[str, torch.Tensor]:
    import smp.torch as smp
    from smp.torch.patches.checkpoint import checkpoint_sequential

    smp.init({"microbatches": 2})
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    model = smp.DistributedModel(seq)

    @smp.step
    def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint_sequential(seq, x, strategy) if strategy else model(x)
        loss = out.pow(2).mean()
        model.backward(loss)
        return loss

    train_step(model, torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
    return {n: p.grad.clone() for n, p in seq.named_parameters()}


def test_checkpoint_sequential_gives_the_same_gradients() -> None:
    plain = run_ranks(_checkpoint_grads, 1, args=(None,))[0]
    for strategy in ("each", "contiguous", "group_2"):
        got = run_ranks(_checkpoint_grads, 1, args=(strategy,))[0]
        for name, grad in plain.items():
            torch.testing.assert_close(got[name], grad)
