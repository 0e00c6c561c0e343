"""Delayed parameter initialisation: meta until smp.DistributedModel, then each rank's own parameters,
with values that depend only on the seed and the module path (same on pp=1 and pp=2, tp=1 and tp=2).
Training from them is compared with a plain torch model given the documented initial values."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers.spawn import run_ranks
from tests.torch import zoo


def _seed(path: str, base: int = 0) -> int:
    """The documented seed of a module's initialisation: sha256 of "<random_seed>:<path>"."""
    return int.from_bytes(hashlib.sha256(f"{base}:{path}".encode()).digest()[:8], "little") & (2**63 - 1)


def _expected_gpt(dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """TinyGPT (in ``dtype``) initialised the documented way: each module with parameters, seeded by its path."""
    net = zoo.TinyGPT().to(dtype)
    for path, m in net.named_modules():
        if path == "head":  # its only parameter is the embedding's (tied): initialised by `tok`
            continue
        if any(True for _ in m.parameters(recurse=False)):
            torch.manual_seed(_seed(path))
            with torch.no_grad():
                (m._reset_parameters if isinstance(m, nn.MultiheadAttention) else m.reset_parameters)()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_context_creates_meta_parameters_and_keeps_buffers_and_ties() -> None:
    import smp.torch as smp

    register = nn.Module.register_parameter
    with smp.delay_param_initialization():
        net = zoo.TinyGPT()
        with smp.delay_param_initialization(enabled=False):
            real = nn.Linear(2, 2)
    assert nn.Module.register_parameter is register
    assert all(p.is_meta for p in net.parameters())
    assert not net.mask.is_meta and torch.isinf(net.mask[0, 1])
    assert net.head.weight is net.tok.weight
    assert not real.weight.is_meta


def _single(_: Any = None) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"delayed_parameter_initialization": True})
    with smp.model_creation(dtype=torch.float64):
        net = zoo.TinyGPT()
    meta_before = all(p.is_meta for p in net.parameters()) and net.tok.weight.dtype == torch.float64
    smp.DistributedModel(net)
    return {"meta_before": meta_before, "tied": net.head.weight is net.tok.weight,
            "default_dtype": torch.get_default_dtype(),
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def test_single_process_materialises_documented_values() -> None:
    out = run_ranks(_single, 1, timeout=60)[0]
    assert out["meta_before"] and out["tied"] and out["default_dtype"] == torch.float32
    expected = _expected_gpt()
    assert set(out["state"]) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(out["state"][k], v, msg=k)


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def _no_initialiser() -> str:
    import smp.torch as smp
    from smp.torch.model.delayed import DelayedInitError

    smp.init({})
    with smp.delay_param_initialization():
        net = _NoInit()
    try:
        smp.DistributedModel(net)
    except DelayedInitError as e:
        return str(e)
    return "no error"


def test_module_without_initialiser_is_a_clear_error() -> None:
    msg = run_ranks(_no_initialiser, 1, timeout=60)[0]
    assert "'w'" in msg and "_NoInit" in msg and "reset_parameters" in msg


def _train_gpt(pp: int, auto: bool = False) -> dict[str, Any]:
    import smp.torch as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2, "auto_partition": auto,
              "default_partition": 0, "comm_timeout": 60.0})
    with smp.delay_param_initialization():
        net = zoo.TinyGPT()
    model = smp.DistributedModel(net)
    if not auto:
        net.place(pp, smp.set_partition)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    losses = zoo.train_losses(model, opt, zoo.train_step("gpt"), zoo.batches("gpt", 2))
    local = {n for n, _ in model.local_named_parameters()}
    sizes = {n: p.numel() for n, p in net.named_parameters()}
    return {"losses": losses, "local": local, "sizes": sizes, "tied": net.head.weight is net.tok.weight,
            "state": model.state_dict()}


@functools.cache
def _gpt_reference() -> dict[str, Any]:
    """A plain torch TinyGPT with the documented initial values, trained in one process on the same batches."""
    net = zoo.TinyGPT()
    net.load_state_dict(_expected_gpt(torch.float32))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in zoo.batches("gpt", 2):
        opt.zero_grad()
        loss = zoo.loss_of("gpt", net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


@pytest.mark.parametrize("pp,auto", [(1, False), (2, False), (2, True)], ids=["pp1", "manual", "auto-untraced"])
def test_pipeline_materialises_local_params_and_matches_one_process(pp: int, auto: bool) -> None:
    ref = _gpt_reference()
    results = run_ranks(_train_gpt, pp, args=(pp, auto), timeout=60)
    assert all(r["local"] for r in results)
    if pp == 2:
        assert not results[0]["local"] & results[1]["local"]
    for r in results:
        assert r["tied"]
        for name, numel in r["sizes"].items():
            assert (numel > 0) == (name in r["local"]), name  # other ranks' parameters hold no storage
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6)
    for k, v in ref["state"].items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def _llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                    use_cache=False)


def _llama_batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(7))


def _train_llama(tp: int) -> tuple[list[float], tuple[int, ...]]:
    import smp.torch as smp
    import transformers

    smp.init({"tensor_parallel_degree": tp, "ddp": True, "prescaled_batch": True, "microbatches": 1,
              "delayed_parameter_initialization": True, "comm_timeout": 60.0})
    with smp.model_creation(tensor_parallelism=True):
        hf = transformers.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation="eager")
    assert all(p.is_meta for p in hf.parameters()) and not hf.model.rotary_emb.inv_freq.is_meta
    model = smp.DistributedModel(hf)
    assert not any(p.is_meta for p in model.parameters())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    train_step = zoo.hf_train_step()

    ids = _llama_batch()
    losses = []
    for _ in range(2):
        opt.zero_grad()
        losses.append(train_step(model, ids, ids.clone()).reduce_mean().item())
        opt.step()
    return losses, tuple(hf.model.layers[0].self_attn.q_proj.weight.shape)


def _llama_reference() -> list[float]:
    """A plain eager Llama given the documented initial values, trained in one process.

    The documented rule: each module with parameters of its own, in ``named_modules()`` order, is
    initialised with the generator seeded by its path, by the ``_init_weights`` of the nearest
    Hugging Face ``PreTrainedModel`` holding it, else by its ``reset_parameters()``.
    """
    import transformers

    hf = transformers.AutoModelForCausalLM.from_config(_llama_config(), attn_implementation="eager")
    modules = dict(hf.named_modules())
    with torch.no_grad():
        for path, m in modules.items():
            own = [p for p in m.parameters(recurse=False)]
            if not own:
                continue
            for p in own:
                p.fill_(float("nan"))
            parts = path.split(".") if path else []
            owner = next(c for c in (modules.get(".".join(parts[:k])) for k in range(len(parts), -1, -1))
                         if isinstance(c, transformers.PreTrainedModel))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed(path))
                owner._init_weights(m)
            if any(torch.isnan(p).any() for p in own):
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(_seed(path))
                    m.reset_parameters()
            assert not any(torch.isnan(p).any() for p in own), path
    opt = torch.optim.SGD(hf.parameters(), lr=0.05)
    ids = _llama_batch()
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = hf(input_ids=ids, labels=ids.clone()).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_llama_tensor_parallel_delayed_matches_one_process() -> None:
    pytest.importorskip("transformers")
    ref = _llama_reference()
    tp1, full_shape = run_ranks(_train_llama, 1, args=(1,), timeout=90)[0]
    assert full_shape == (32, 32)
    torch.testing.assert_close(torch.tensor(tp1), torch.tensor(ref), rtol=1e-4, atol=1e-5)
    for losses, shape in run_ranks(_train_llama, 2, args=(2,), timeout=90):
        assert shape == (16, 32)  # a meta shard of the column-parallel q_proj, materialised as a slice
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-5)
