"""SMP v1-style scripts run unchanged apart from the import: the pt_mnist.py shape under torchrun,
and the SMP v1 checkpointing helpers (`smp.checkpoint`, `checkpoint_sequential`). The example scripts'
per-step losses, on every rank, are compared with the same model trained by a plain torch loop in
one process on the same global batches."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any

import torch
from torch import nn

from tests.helpers.scripts import run_script
from tests.helpers.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example(name: str) -> Any:
    """Import examples/<name>.py (its model and data) without running it."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_losses(prefix: Any, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        with open(f"{prefix}_{r}.json") as f:
            out.append(json.load(f))
    return out


def _mnist_reference(samples: int, batch: int, replicas: int) -> list[list[float]]:
    """examples/mnist_smp_v1.py in one process: per step, the loss on each replica's rows.

    The script seeds with 1 + dp_rank and DP rank 0's initial weights are broadcast, so the model
    is built after seed 1; replica d reads its contiguous share of the data in order (no shuffle),
    and the gradient averaged over replicas is the gradient of the mean over their rows.
    """
    ex = _example("mnist_smp_v1")
    torch.manual_seed(1)
    model = ex.GroupedNet(0.0)
    images, labels = ex.synthetic_mnist(samples, 0).tensors
    share = samples // replicas
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    out = []
    for step in range(share // batch):
        rows = [slice(d * share + step * batch, d * share + (step + 1) * batch) for d in range(replicas)]
        opt.zero_grad()
        per_replica = [torch.nn.functional.nll_loss(model(images[r]), labels[r]) for r in rows]
        out.append([loss.item() for loss in per_replica])
        (sum(per_replica) / replicas).backward()
        opt.step()
    return out


def test_pt_mnist_shape_trains_on_four_ranks(tmp_path: Any) -> None:
    """2 partitions x 2 data-parallel replicas, spread placement, GradScaler, Adadelta, StepLR,
    list outputs of an evaluation step, and partial smp.save on dp_rank 0. Dropout off and data in
    order, so that every rank's losses equal one process training on both replicas' rows."""
    out = run_script("torchrun", "examples/mnist_smp_v1.py", ["--epochs", "1", "--samples", "512", "--save",
                                                             str(tmp_path), "--dropout", "0", "--no-shuffle",
                                                             "--losses", str(tmp_path / "losses")], nproc=4)
    ref = _mnist_reference(512, 64, 2)
    for rank, got in enumerate(_rank_losses(tmp_path / "losses", 4)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor([s[got["dp_rank"]] for s in ref]),
                                   rtol=1e-4, atol=1e-5, msg=lambda m, r=rank: f"rank {r}: losses\n{m}")
    m = re.search(r"train loss [\d.]+ \(first ([\d.]+), last ([\d.]+)\).*accuracy ([\d.]+)", out)
    assert m, out
    first, last, accuracy = (float(g) for g in m.groups())
    assert last < first / 2 and accuracy > 0.5, out
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("mnist")) == ["mnist_checkpoint_0_0.pt",
                                                                                "mnist_checkpoint_1_0.pt"]
    saved = torch.load(tmp_path / "mnist_checkpoint_1_0.pt", weights_only=False)
    assert saved["model_state_dict"]["_smp_is_partial"] is True


def test_tensor_parallel_hf_script_trains_checkpoints_and_exports(tmp_path: Any) -> None:
    """examples/tp_hf_smp_v1.py: an HF Llama marked with smp.tensor_parallelism(), tp=2 x pp=2, SMP v1's
    default per-rank batches, automatic partition; the Hugging Face export loads in plain transformers."""
    out = run_script("torchrun", "examples/tp_hf_smp_v1.py", ["--steps", "12", "--out", str(tmp_path), "--losses",
                                                              str(tmp_path / "losses")], nproc=4)
    ref = _tp_hf_reference(12)
    for rank, got in enumerate(_rank_losses(tmp_path / "losses", 4)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, r=rank: f"rank {r}: losses\n{m}")
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", out)]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, out
    assert os.path.isdir(tmp_path / "checkpoint")
    import transformers

    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    ids = (torch.arange(32) + 7).remainder(256)[None]
    with torch.no_grad():
        loss = plain(input_ids=ids, labels=ids).loss.item()
    assert loss < losses[0] - 0.5, "the exported model holds the trained weights"


def _tp_hf_reference(steps: int, batch: int = 4, seq: int = 32, vocab: int = 256) -> list[float]:
    """examples/tp_hf_smp_v1.py (Llama) in one process: the two TP ranks' per-rank batches (drawn by
    dp_rank 0 and 1) are the batch the TP group runs on, and the loss the model computes is over it."""
    import transformers

    ex = _example("tp_hf_smp_v1")
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(ex.CONFIGS["llama"](vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gens = [torch.Generator().manual_seed(d) for d in range(2)]
    out = []
    for _ in range(steps):
        ids = torch.cat([(torch.randint(0, vocab, (batch, 1), generator=g) + torch.arange(seq)) % vocab for g in gens])
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


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


def _torchrun(script: str, *args: str) -> str:
    return run_script("torchrun", script, args, nproc=4)


def test_gpt2_simple_script_tp2_pp2_fp16_resumes_exactly_and_exports_to_hf(tmp_path: Any) -> None:
    """examples/train_gpt_simple.py (SMP v1's GPT-2 example shape): tp=2 x pp=2, delayed init, SMP v1's
    structure (transformer.seq_layers) with every layer checkpointed, fp16 with dynamic loss scaling and
    clip_master_grads. A run resumed from its step-4 checkpoint repeats the uninterrupted run's losses
    exactly on every rank; the translated full model loads into plain transformers; at tp=1 x pp=2 x dp=2
    the script (which reads seq_layers) runs too, with fp16 and sharded optimizer state."""
    import transformers

    ckpt = str(tmp_path / "ckpt")
    common = ["--fp16", "1", "--steps", "8", "--checkpoint-dir", ckpt]
    straight = _torchrun("examples/train_gpt_simple.py", *common, "--save-every", "4",
                         "--losses", str(tmp_path / "straight"))
    _torchrun("examples/train_gpt_simple.py", *common, "--resume", "1", "--losses", str(tmp_path / "resumed"))
    for rank, (a, b) in enumerate(zip(_rank_losses(tmp_path / "straight", 4), _rank_losses(tmp_path / "resumed", 4))):
        assert b["start"] == 4, b
        assert b["losses"] == a["losses"][4:], f"rank {rank}: resumed {b['losses']} vs {a['losses'][4:]}"
    losses = [float(x) for x in re.findall(r"loss ([\d.]+)", straight)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.1, straight

    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    plain = transformers.GPT2LMHeadModel(cfg)
    state = torch.load(os.path.join(ckpt, "hf_gpt2.pt"), weights_only=False)
    plain.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    ids = (torch.arange(32) + 7).remainder(256)[None]
    with torch.no_grad():
        assert plain(input_ids=ids, labels=ids).loss.item() < losses[0] - 0.1, "the export holds the trained weights"

    tp1 = _torchrun("examples/train_gpt_simple.py", "--tp", "1", "--steps", "4", "--checkpoint-dir",
                    str(tmp_path / "tp1"), "--fp16", "1", "--shard-optimizer-state", "1", "--save-every", "3")
    assert "transformer.seq_layers.2-3 (2)" in tp1
    assert os.path.exists(tmp_path / "tp1" / "hf_gpt2.pt")
    # pp=2 x dp=2 with sharded optimizer state: one optimizer file per (stage, replica), SMP v1's v3 names.
    saved = sorted(os.listdir(tmp_path / "tp1" / "step_3_partial"))
    assert [f for f in saved if f.startswith("optimizer_")] == [f"optimizer_{pp}_0_{rdp}.pt" for pp in (0, 1)
                                                                for rdp in (0, 1)], saved
