"""The conformance pack: SMP v1 scripts in the shapes users ran (tests/torch/conformance/), launched
whole under torchrun or mpiexec. Each compares with one process or, where the script resumes,
with its own uninterrupted run; a change that breaks a real script's call shapes fails here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.scripts import ROOT, run_script

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
HERE = os.path.join(ROOT, "tests", "torch", "conformance")


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_conformance_{name}", os.path.join(HERE, f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(prefix: Any, world: int) -> list[dict[str, Any]]:
    out = []
    for rank in range(world):
        with open(f"{prefix}_{rank}.json") as f:
            out.append(json.load(f))
    return out


# --- the developer guide's manual partition, under MPI, configured by SM_HP_MP_PARAMETERS ----------

def _devguide_reference(samples: int = 256, batch: int = 32) -> list[list[float]]:
    """One process: per step, each DP replica's loss; the gradient is the mean of the replicas'."""
    script = _script("devguide_manual")
    torch.manual_seed(0)
    net = script.Net()
    images, labels = script.synthetic_mnist(samples, 0).tensors
    opt = torch.optim.Adadelta(net.parameters(), lr=1.0)
    share, out = samples // 2, []
    for step in range(share // batch):
        rows = [slice(d * share + step * batch, d * share + (step + 1) * batch) for d in range(2)]
        opt.zero_grad()
        losses = [F.nll_loss(net(images[r]), labels[r]) for r in rows]
        (sum(losses) / 2).backward()
        opt.step()
        out.append([loss.item() for loss in losses])
    return out


@pytest.mark.mpi
def test_developer_guide_manual_partition_under_mpiexec(tmp_path: Any) -> None:
    params = {"partitions": 2, "microbatches": 4, "auto_partition": False, "default_partition": 0,
              "pipeline": "interleaved", "optimize": "speed", "placement_strategy": "spread", "ddp": True}
    run_script("mpiexec", os.path.join(HERE, "devguide_manual.py"), ["--losses", str(tmp_path / "l")], nproc=4,
               env={"SM_HP_MP_PARAMETERS": json.dumps(params)})
    ref = _devguide_reference()
    for rank, got in enumerate(_results(tmp_path / "l", 4)):
        torch.testing.assert_close(got["losses"], [step[got["dp_rank"]] for step in ref], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")


# --- SMP v1's test_final_loss_equal at tp2 x pp2: save, load partial (directly, in a hook), load full

def test_final_loss_equal_tp2_pp2_saves_and_loads_in_every_mode(tmp_path: Any) -> None:
    script = os.path.join(HERE, "final_loss_equal.py")
    lr = ["--lr", "0.05"]

    def run(name: str, *args: str) -> list[dict[str, Any]]:
        run_script("torchrun", script, [*args, *lr, "--results", str(tmp_path / name)], nproc=4, cwd=str(tmp_path))
        return _results(tmp_path / name, 4)

    saved = run("save", "--save-partial-model", "--save-full-model")
    files = sorted(n for n in os.listdir(tmp_path) if n.startswith("pt_mnist_checkpoint"))
    assert files == ["pt_mnist_checkpoint.pt"] + [f"pt_mnist_checkpoint.pt_{p}_{t}.pt" for p in (0, 1) for t in (0, 1)]
    full = torch.load(tmp_path / "pt_mnist_checkpoint.pt", weights_only=False)
    assert full["model_state_dict"]["net2.fc1.linear.weight"].shape == (128, 9216), "the TP layer's full weight"
    assert full["optimizer_state_dict"]["state"]["net2.fc1.linear.weight"]["square_avg"].shape == (128, 9216)
    final = saved[0]["test_loss"]
    assert all(r["test_loss"] == final for r in saved) and saved[0]["losses"][-1] < saved[0]["losses"][0] - 0.5
    direct = run("direct", "--partial-checkpoint", "pt_mnist_checkpoint.pt")
    hook = run("hook", "--partial-checkpoint", "pt_mnist_checkpoint.pt", "--load-in-hook", "1")
    full_hook = run("full", "--full-checkpoint", "pt_mnist_checkpoint.pt", "--load-in-hook", "1")
    for name, ranks in (("direct", direct), ("hook", hook), ("full in hook", full_hook)):
        assert all(r["first_test_loss"] == final for r in ranks), (name, [r["first_test_loss"] for r in ranks], final)
    for a, b in zip(direct, hook):  # model and optimizer state: the same continuation either way
        assert a["losses"] == b["losses"], (a["rank"], a["losses"], b["losses"])
    for a, b in zip(direct, full_hook):  # a full checkpoint holds no optimizer state: Adadelta starts afresh
        assert a["losses"][0] == b["losses"][0] and a["losses"][1:] != b["losses"][1:]


# --- the GPT-2 train_gpt_simple.py of May 2022 at tp2 x pp2: save, resume, full model in HF names ---

def test_gpt2_simple_2022_tp2_pp2_resumes_exactly_and_loads_its_full_hf_model(tmp_path: Any) -> None:
    script = os.path.join(HERE, "gpt2_simple_2022.py")
    ckpt, model_dir = str(tmp_path / "ckpt"), str(tmp_path / "model")

    def run(*args: str) -> str:
        return run_script("torchrun", script, ["--checkpoint-dir", ckpt, "--model-dir", model_dir, *args], nproc=4)

    first = run("--max_steps", "4", "--save_final_full_model", "1")
    assert "initialised afresh" in first and "PreTrainedModel.init_weights" in first, "the user is told"
    run("--max_steps", "8", "--checkpoint_freq", "100", "--checkpoint-dir", str(tmp_path / "none"),
        "--losses", str(tmp_path / "straight"))
    run("--max_steps", "8", "--checkpoint_freq", "100", "--load_partial", "1", "--losses", str(tmp_path / "partial"))
    run("--max_steps", "5", "--checkpoint_freq", "100", "--load_full", "1", "--losses", str(tmp_path / "full"))
    straight, partial = _results(tmp_path / "straight", 4), _results(tmp_path / "partial", 4)
    for rank, (a, b) in enumerate(zip(straight, partial)):
        assert b["start"] == 4 and b["losses"] == a["losses"][4:], f"rank {rank}: {b['losses']} vs {a['losses'][4:]}"
    assert straight[0]["losses"][-1] < straight[0]["losses"][0]
    # The final full model, in Hugging Face names, is plain GPT-2 to transformers: on the batch the
    # load_full run started from (its saved batch_idx 0), both give the same loss.
    (name,) = os.listdir(model_dir)
    saved = torch.load(os.path.join(model_dir, name), weights_only=False)
    assert re.fullmatch(r"trained_gpt_nparams-\d+_steps-4\.pt", name) and saved["total_steps"] == 4
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    plain = transformers.GPT2LMHeadModel(cfg)
    plain.load_state_dict(saved["model"], strict=True)
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 256, (4, 1), generator=g) + torch.arange(32)) % 256
    with torch.no_grad():
        expected = plain(input_ids=ids, labels=ids).loss.item()
    for got in _results(tmp_path / "full", 4):
        assert got["start"] == 4
        torch.testing.assert_close(got["losses"][0], expected, rtol=1e-5, atol=1e-5)


# --- the Hugging Face Trainer's SMP path: pp2 x dp2, gradient accumulation, save and resume -------

TRAINER_PARAMS = {"partitions": 2, "microbatches": 2, "ddp": True, "pipeline": "interleaved", "optimize": "speed"}


def _trainer_reference(samples: int = 64, batch: int = 4, accumulation: int = 2) -> list[list[float]]:
    """One process: per optimizer step, each DP replica's accumulated loss (replica d reads rows d::2)."""
    transformers.set_seed(42)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    data = ((torch.randint(0, 128, (samples + 16, 1), generator=g) + torch.arange(16)) % 128)[:samples]
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3)
    per_replica = [data[d::2] for d in range(2)]
    steps = len(per_replica[0]) // batch // accumulation
    sched = transformers.get_linear_schedule_with_warmup(opt, 2, steps)
    out = []
    for step in range(steps):
        opt.zero_grad()
        totals = [0.0, 0.0]
        for micro in range(accumulation):
            b = step * accumulation + micro
            for d in range(2):
                ids = per_replica[d][b * batch:(b + 1) * batch]
                loss = model(input_ids=ids, labels=ids).loss / accumulation
                (loss / 2).backward()
                totals[d] += loss.item()
        opt.step()
        sched.step()
        out.append(totals)
    return out


def test_hf_trainer_smp_path_trains_like_one_process_and_resumes(tmp_path: Any) -> None:
    script = os.path.join(HERE, "hf_trainer_smp.py")
    env = {"SM_HP_MP_PARAMETERS": json.dumps(TRAINER_PARAMS)}
    out = run_script("torchrun", script, ["--output_dir", str(tmp_path / "run"), "--losses", str(tmp_path / "straight")],
                     nproc=4, env=env)
    assert sorted(os.listdir(tmp_path / "run")) == ["checkpoint-2", "checkpoint-4"], out[-2000:]
    run_script("torchrun", script, ["--output_dir", str(tmp_path / "again"), "--resume_from_checkpoint",
                                    str(tmp_path / "run" / "checkpoint-2"), "--losses", str(tmp_path / "resumed")],
               nproc=4, env=env)
    ref = _trainer_reference()
    straight, resumed = _results(tmp_path / "straight", 4), _results(tmp_path / "resumed", 4)
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        torch.testing.assert_close(a["losses"], [step[a["dp_rank"]] for step in ref], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, r=rank: f"rank {r}: {m}")
        # A full checkpoint partitions afresh, so a resumed run may cut elsewhere: the same numbers up
        # to float rounding (the optimizer state follows the parameters to their new ranks).
        assert b["global_step"] == 4 and len(b["losses"]) == 2
        torch.testing.assert_close(b["losses"], a["losses"][2:], rtol=1e-6, atol=1e-6)
        assert b["eval"]["logits_rows"] == 16 and b["eval"]["eval_loss"] == pytest.approx(a["eval"]["eval_loss"],
                                                                                        rel=1e-6)
