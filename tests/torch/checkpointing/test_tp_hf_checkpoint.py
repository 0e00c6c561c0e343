"""A TP model saved in Hugging Face format loads in plain transformers; an HF checkpoint loads shard by shard."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch import zoo
from tests.torch.tp.test_tp_hf import _batch, _model

transformers = pytest.importorskip("transformers")


def _train_and_save(kind: str, path: str) -> torch.Tensor:
    import smp.torch as smp
    from smp.torch.tp import save_pretrained

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.transform(_model(kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, labels = _batch()
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    save_pretrained(model, path)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _load_shards(kind: str, path: str) -> torch.Tensor:
    import smp.torch as smp
    from smp.torch.tp import load_hf_checkpoint

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.transform(_model(kind, seed=100 + smp.rank()))  # different weights until loaded
    assert load_hf_checkpoint(model, path) == []
    with torch.no_grad():
        return model(input_ids=_batch()[0]).logits


@pytest.mark.parametrize("kind", ["llama", "mixtral", "gpt2"])
def test_save_pretrained_round_trip(kind: str, tmp_path: object) -> None:
    path = str(tmp_path)
    trained = run_ranks(_train_and_save, 2, args=(kind, path), timeout=180)
    torch.testing.assert_close(trained[0], trained[1])
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        logits = plain(input_ids=_batch()[0]).logits
    torch.testing.assert_close(logits, trained[0], rtol=1e-5, atol=1e-5)
    untrained = _model(kind)(input_ids=_batch()[0]).logits.detach()
    assert not torch.allclose(untrained, logits, atol=1e-3), "the checkpoint holds the trained weights"
    loaded = run_ranks(_load_shards, 2, args=(kind, path), timeout=180)
    torch.testing.assert_close(loaded[0], logits, rtol=1e-5, atol=1e-5)


# --- smp.DistributedModel.save_pretrained: any TP x PP layout -> one plain Hugging Face checkpoint ---

def _distributed_train_and_save(path: str, tp: int, pp: int, how: str, over: dict[str, Any]) -> torch.Tensor:
    """Train 2 steps at tp x pp, save_pretrained, return the full logits of the trained model (forward-only step)."""
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "ddp": True, "prescaled_batch": True,
              "microbatches": 3, "auto_partition": False, "default_partition": 0, "comm_timeout": 60.0})
    hf = _model("llama", **over)
    if how == "transform":
        smp.transform(hf)
    elif how == "marked":
        smp.set_tensor_parallelism(hf)  # converted when DistributedModel wraps it
    model = smp.DistributedModel(hf)
    if tp > 1:
        from smp.torch.nn import is_tp_sharded

        assert is_tp_sharded(model.get_module().get_input_embeddings().weight), "the model is tensor-parallel"
    if pp > 1:  # the second half of the layers on stage 1; embeddings, final norm and lm_head on stage 0
        for layer in hf.model.layers[len(hf.model.layers) // 2:]:
            smp.set_partition(layer, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    train_step = zoo.hf_train_step()

    @smp.step
    def logits_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    ids, labels = _batch()
    for _ in range(2):
        opt.zero_grad()
        train_step(model, ids, labels)
        opt.step()
    model.save_pretrained(path)
    with torch.no_grad():
        logits = logits_step(model, ids).concat()
    return logits


_PLAIN = """
import sys, torch, transformers
ids = torch.load(sys.argv[2])
plain = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="eager")
with torch.no_grad():
    torch.save(plain(input_ids=ids).logits, sys.argv[3])
assert not any(m == "smp" or m.startswith("smp.") for m in sys.modules), "smp was imported"
"""


def _plain_logits(path: str) -> torch.Tensor:
    """The checkpoint's logits from plain transformers in a fresh process that never imports smp."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        ids, out = os.path.join(d, "ids.pt"), os.path.join(d, "logits.pt")
        torch.save(_batch()[0], ids)
        subprocess.run([sys.executable, "-c", _PLAIN, path, ids, out], check=True, timeout=120, cwd=d)
        return torch.load(out)


@pytest.mark.parametrize("tp,pp,rdp,how,tied", [(2, 2, 1, "transform", False), (2, 2, 1, "marked", True),
                                                (1, 2, 1, "plain", False), (2, 1, 2, "transform", False)],
                         ids=["tp2-pp2", "tp2-pp2-marked-tied", "pp2-plain-hf", "tp2-rdp2"])
def test_distributed_model_save_pretrained_loads_in_plain_transformers(tp: int, pp: int, rdp: int, how: str,
                                                                       tied: bool, tmp_path: Any) -> None:
    path = str(tmp_path)
    over = {"tie_word_embeddings": True} if tied else {}
    trained = run_ranks(_distributed_train_and_save, tp * pp * rdp, args=(path, tp, pp, how, over), timeout=120)
    for other in trained[1:]:
        torch.testing.assert_close(other, trained[0])
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    logits = _plain_logits(path)
    torch.testing.assert_close(logits, trained[0], rtol=1e-5, atol=1e-5)
    untrained = _model("llama", **over)(input_ids=_batch()[0]).logits.detach()
    assert not torch.allclose(untrained, logits, atol=1e-3), "the checkpoint holds the trained weights"
    if tied:
        from safetensors import safe_open

        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            assert f.get_tensor("model.embed_tokens.weight").shape == (64, 32)


# Four key/value heads so that the checkpoint also splits over tp=4.
KV4 = {"num_key_value_heads": 4}


def _load_at(path: str) -> torch.Tensor:
    import smp.torch as smp
    from smp.torch.tp import load_hf_checkpoint

    smp.init({"tensor_parallel_degree": smp_size(), "ddp": True, "comm_timeout": 60.0})
    model = smp.transform(_model("llama", seed=100 + smp.rank(), **KV4))  # different weights until loaded
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in _model("llama", **KV4).parameters())
    assert load_hf_checkpoint(model, path) == []
    with torch.no_grad():
        return model(input_ids=_batch()[0]).logits


def smp_size() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


def test_resharding_save_at_tp2_load_at_tp1_and_tp4(tmp_path: Any) -> None:
    path = str(tmp_path)
    trained = run_ranks(_distributed_train_and_save, 2, args=(path, 2, 1, "transform", KV4), timeout=120)
    torch.testing.assert_close(_plain_logits(path), trained[0], rtol=1e-5, atol=1e-5)  # tp=1, without smp
    loaded = run_ranks(_load_at, 4, args=(path,), timeout=120)  # tp=4, each rank reads its quarter
    for logits in loaded:
        torch.testing.assert_close(logits, trained[0], rtol=1e-5, atol=1e-5)


def _save_non_hf(path: str) -> str:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    try:
        model.save_pretrained(path)
    except TypeError as e:
        return str(e)
    return "no error"


def test_save_pretrained_of_a_non_hf_model_is_refused_clearly(tmp_path: Any) -> None:
    message = run_ranks(_save_non_hf, 1, args=(str(tmp_path),), timeout=60)[0]
    assert "not a Hugging Face PreTrainedModel" in message and "Linear" in message


def _smp_checkpoints(path: str, phase: str) -> Any:
    """tp=2 x pp=2: 'save' trains 2 steps with a manual partition and writes a partial and a full
    checkpoint; 'resume' starts with automatic partitioning (which would split differently) and must
    take the saved partition; 'full' loads the full checkpoint at the same layout."""
    import smp.torch as smp

    resume = phase != "save"
    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": True, "microbatches": 3,
              "prescaled_batch": True, "auto_partition": resume, "default_partition": 0, "comm_timeout": 60.0})
    hf = _model("llama", seed=5 if resume else 0)  # resumed runs start from other weights
    smp.transform(hf)
    model = smp.DistributedModel(hf)
    if not resume:
        for layer in hf.model.layers[1:]:
            smp.set_partition(layer, 1)
        smp.set_partition(hf.lm_head, 1)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    if phase == "resume":
        smp.resume_from_checkpoint(path, tag="step2")
    elif phase == "full":
        smp.resume_from_checkpoint(path, tag="full", partial=False)

    train_step = zoo.hf_train_step()

    ids, labels = _batch()
    losses = []
    for _ in range(1 if phase == "full" else 2 if resume else 4):
        opt.zero_grad()
        losses.append(train_step(model, ids, labels).reduce_mean().item())
        if phase != "full":
            opt.step()
        if phase == "save" and len(losses) == 2:
            smp.save_checkpoint(path, tag="step2", partial=True, model=model, optimizer=opt)
            smp.save_checkpoint(path, tag="full", partial=False, model=model)
            full = model.state_dict()
            if smp.rank() == 0:
                assert full["model.embed_tokens.weight"].shape == (64, 32), "state_dict() holds full tensors"
    owner = {p: r for p, r in model.partition_assignment.items() if p in ("lm_head", "model.layers.0", "model.layers.1")}
    return losses, owner


def test_smp_checkpoints_under_tp_pp_keep_partition_and_full_tensors(tmp_path: Any) -> None:
    path = str(tmp_path)
    saved = run_ranks(_smp_checkpoints, 4, args=(path, "save"), timeout=240)
    losses, owner = saved[0]
    assert owner == {"lm_head": 1, "model.layers.0": 0, "model.layers.1": 1}
    # The full checkpoint is the unsharded model: it loads into plain transformers.
    plain = _model("llama", seed=5)
    state = torch.load(str(tmp_path / "full"), weights_only=False)  # SMP v1's full checkpoint file
    state = state.get("model", state) if isinstance(state, dict) else state
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("_smp")})
    ids, labels = _batch()
    with torch.no_grad():  # the step's loss is the mean of the 3 one-sequence microbatches' losses
        plain_loss = sum(plain(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss.item() for i in range(3)) / 3
    assert abs(plain_loss - losses[2]) < 1e-4
    # Resuming the partial checkpoint under automatic partitioning keeps the saved partition and
    # continues with the same losses; the full checkpoint loads at the TP x PP layout too.
    for resumed_losses, resumed_owner in run_ranks(_smp_checkpoints, 4, args=(path, "resume"), timeout=240):
        assert resumed_owner == owner
        torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(losses[2:]), rtol=1e-5, atol=1e-6)
    for full_losses, _ in run_ranks(_smp_checkpoints, 4, args=(path, "full"), timeout=240):
        assert abs(full_losses[0] - losses[2]) < 1e-4
    for msg in run_ranks(_resume_in_another_layout, 4, args=(path,), timeout=240):
        assert "pipeline_parallel_degree 2 -> 1" in msg and "partial=False" in msg, msg


def _resume_in_another_layout(path: str) -> str:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 1, "ddp": True, "comm_timeout": 60.0})
    smp.DistributedModel(smp.transform(_model("llama")))
    try:
        smp.resume_from_checkpoint(path, tag="step2")
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"
