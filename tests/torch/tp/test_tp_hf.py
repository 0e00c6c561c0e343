"""`smp.torch.transform` of Hugging Face models at tp=2 and tp=4 against the unsharded model in one process.

The multi-rank cases of one world size run in one launch, ``smp.reset()`` between; a failure names
its case.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tests.torch.launch_cases import Case, run_cases

transformers = pytest.importorskip("transformers")

KINDS = ["llama", "mistral", "gpt_neox", "mixtral"]
RELATED = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma": "GemmaConfig", "gptj": "GPTJConfig"}
V1_ONLY = ["gpt2"]  # SMP v1's flagship TP model; its config has no base_model_tp_plan


def _config(kind: str, **over: Any) -> Any:
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 32, "use_cache": False, **over}
    if kind == "llama":
        return transformers.LlamaConfig(**{"num_key_value_heads": 2, **common})
    if kind == "mistral":
        return transformers.MistralConfig(**{"num_key_value_heads": 2, **common})
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(**common)
    if kind == "gpt2":  # Conv1D projections, fused q | k | v, tied embeddings, no tp plan in its config
        return transformers.GPT2Config(**{"n_inner": 48, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                                          **common})
    if kind == "gptj":
        return transformers.GPTJConfig(**{"n_inner": 48, "rotary_dim": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                          "attn_pdrop": 0.0, **common})
    if kind in RELATED:  # converted from their base_model_tp_plan, no family entry of their own
        return getattr(transformers, RELATED[kind])(**{"num_key_value_heads": 2, "head_dim": 8, **common})
    return transformers.MixtralConfig(**{"num_key_value_heads": 2, "num_local_experts": 4,
                                         "num_experts_per_tok": 2, **common})


def _model(kind: str, seed: int = 0, **over: Any) -> Any:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(_config(kind, **over), attn_implementation="eager")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (3, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _tp2(kind: str, from_rank0: bool, tied: bool, parallel_loss: bool = True) -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict, is_tp_sharded

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    over = {"tie_word_embeddings": True} if tied else {}
    dense = _model(kind, **over)
    # With load_state_dict_from_rank0, rank 1 starts from different weights and must end up with rank 0's.
    model = _model(kind, seed=smp.rank() if from_rank0 else 0, **over)
    ids, labels = _batch()
    ref = dense(input_ids=ids, labels=labels)
    ref.loss.backward()
    smp.transform(model, load_state_dict_from_rank0=from_rank0, parallel_loss=parallel_loss)
    group = smp.get_tp_process_group()
    # Each rank stores exactly half of every sharded parameter, and all of every replicated one.
    dense_params = dict(dense.named_parameters())
    sharded = [n for n, p in model.named_parameters() if is_tp_sharded(p)]
    assert is_tp_sharded(model.get_input_embeddings().weight) and is_tp_sharded(model.get_output_embeddings().weight)
    assert len(sharded) >= 1 + 4 * 2, "per layer at least the attention and MLP projections"
    for name, p in model.named_parameters():
        assert p.numel() * (2 if name in sharded else 1) == dense_params[name].numel(), name
    assert model.get_input_embeddings().weight.shape[0] == 32
    out = model(input_ids=ids, labels=labels)
    if parallel_loss:
        assert out.logits.shape[-1] == 64, "the full logits are returned (the loss used this rank's slice)"
        logits = out.logits.detach()
    else:
        assert out.logits.shape[-1] == 64, "parallel_loss=False gathers the logits"
        logits = out.logits.detach()
    torch.testing.assert_close(logits, ref.logits.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    grads = full_state_dict(model, group, grads=True)
    ref_grads = {n: p.grad for n, p in dense.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}")
    weights = full_state_dict(model, group)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return "ok"


def _bad_sizes() -> str:
    import smp.torch as smp
    from smp.torch.nn import TPShardingError

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    with pytest.raises(TPShardingError) as info:
        smp.transform(_model("llama", num_key_value_heads=1, vocab_size=63))
    text = str(info.value)
    assert "num_key_value_heads=1" in text and "vocab_size=63" in text and "tensor_parallel_degree=2" in text
    assert "num_attention_heads" not in text
    return "ok"


def test_transform_rejects_an_unsupported_model_type() -> None:
    import smp.torch as smp

    cfg = transformers.GPTNeoConfig(hidden_size=16, num_layers=1, num_heads=2, vocab_size=32,
                                    attention_types=[[["global"], 1]])
    with pytest.raises(ValueError, match="model_type='gpt_neo'.*no usable base_model_tp_plan.*supported: "
                                         "\\['gpt2', 'gpt_neox', 'llama', 'mistral', 'mixtral'\\]"):
        smp.transform(transformers.GPTNeoForCausalLM(cfg))
    phi = transformers.Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with pytest.raises(ValueError, match="styles smp does not implement: \\['colwise_gather_output', "
                                         "'rowwise_split_input'\\]"):
        smp.transform(transformers.Phi3ForCausalLM(phi))


def test_transform_at_tp1_keeps_the_model_numerically_identical() -> None:
    import smp.torch as smp

    model = _model("mixtral")
    dense = copy.deepcopy(model)
    ids, labels = _batch()
    smp.transform(model)
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, dense(input_ids=ids, labels=labels).loss)
    with pytest.raises(ValueError, match="already converted"):
        smp.transform(model)


def test_attention_dropout_draws_from_the_tp_generator_and_is_reproducible() -> None:
    import smp.torch as smp
    from smp.torch.nn import seed_tensor_parallel

    model = smp.transform(_model("llama", attention_dropout=0.5))
    model.train()
    ids, labels = _batch()
    losses = []
    for _ in range(2):
        seed_tensor_parallel(3)
        torch.manual_seed(11)
        before = torch.get_rng_state()
        losses.append(model(input_ids=ids, labels=labels).loss.item())
        assert torch.equal(torch.get_rng_state(), before), "dropout must not draw from the default generator"
    assert losses[0] == losses[1]
    model.eval()
    seed_tensor_parallel(3)
    assert model(input_ids=ids, labels=labels).loss.item() != losses[0], "dropout was active in training"


def _tp4(kind: str) -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    smp.init({"tensor_parallel_degree": 4, "ddp": True, "comm_timeout": 90.0})
    over = {} if kind == "gpt_neox" else {"num_key_value_heads": 4}
    dense, model = _model(kind, **over), _model(kind, **over)
    ids, labels = _batch()
    ref = dense(input_ids=ids, labels=labels)
    ref.loss.backward()
    smp.transform(model)
    from smp.torch.nn import is_tp_sharded

    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():  # exactly 1/4 of every sharded parameter per rank
        assert p.numel() * (4 if is_tp_sharded(p) else 1) == dense_params[name].numel(), name
    out = model(input_ids=ids, labels=labels)
    group = smp.get_tp_process_group()
    assert out.logits.shape[-1] == 64
    torch.testing.assert_close(out.logits.detach(), ref.logits.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    grads = full_state_dict(model, group, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
    return "ok"


def test_transform_tp4_on_4_ranks() -> None:
    """Every family at tp=4 (one launch, reset between)."""
    cases: list[Case] = [(f"tp4-{kind}", _tp4, {"kind": kind}) for kind in KINDS]
    for name, per_rank in run_cases(4, cases, timeout=900).items():
        assert per_rank == ["ok"] * 4, (name, per_rank)


def _fresh() -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict
    from smp.torch.tp.convert import _fresh_weights

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "random_seed": 3, "comm_timeout": 60.0})
    original = _model("llama")
    dense = _model("llama", seed=42)
    _fresh_weights(dense)  # the same initialisation, unsharded, in this process
    model = _model("llama", seed=smp.rank())  # the ranks start from different weights
    torch.manual_seed(1000 + smp.rank())
    before = torch.get_rng_state()
    smp.transform(model, init_weights=True)
    assert torch.equal(torch.get_rng_state(), before), "the caller's random state is untouched"
    weights = full_state_dict(model, smp.get_tp_process_group())
    for name, p in dense.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=0, atol=0)
    assert not torch.equal(weights["model.layers.0.mlp.up_proj.weight"],
                           original.model.layers[0].mlp.up_proj.weight), "fresh, not the original weights"
    return "ok"


def _sliced_logits() -> str:
    import smp.torch as smp
    from smp.torch.nn import gather_from_tp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    dense = _model("llama")
    model = smp.transform(_model("llama"), gather_logits=False)
    ids, labels = _batch()
    out, ref = model(input_ids=ids, labels=labels), dense(input_ids=ids, labels=labels)
    assert out.logits.shape[-1] == 32, "gather_logits=False: this rank's vocabulary slice"
    torch.testing.assert_close(gather_from_tp(out.logits.detach(), smp.get_tp_process_group()), ref.logits.detach(),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    return "ok"


def _tp2_case(kind: str, from_rank0: bool = False, tied: bool = False, parallel_loss: bool = True) -> dict[str, Any]:
    return {"kind": kind, "from_rank0": from_rank0, "tied": tied, "parallel_loss": parallel_loss}


TWO_RANKS: list[Case] = [
    *[(f"tp2-{kind}", _tp2, _tp2_case(kind)) for kind in KINDS],
    # Related models, converted from their config's base_model_tp_plan, and GPT-2 (SMP v1's own).
    *[(f"tp2-{kind}-read-from-its-plan", _tp2, _tp2_case(kind)) for kind in sorted(RELATED) + V1_ONLY],
    ("tp2-loads-rank0-weights-and-keeps-tied-embeddings", _tp2, _tp2_case("llama", True, True)),
    ("tp2-gathered-logits-and-hugging-face-loss", _tp2, _tp2_case("mistral", parallel_loss=False)),
    ("lists-every-size-that-does-not-split", _bad_sizes, {}),
    ("fresh-weights-are-the-same-model-on-every-tp-rank", _fresh, {}),
    ("can-keep-the-logits-vocabulary-sharded", _sliced_logits, {}),
]


def test_transform_on_2_ranks() -> None:
    """Every family and related model at tp=2 against the unsharded model, loading rank 0's weights
    with tied embeddings, gathered logits with Hugging Face's loss, sizes that do not split, fresh
    weights and vocabulary-sharded logits (one launch, reset between; a failure names its case)."""
    for name, per_rank in run_cases(2, TWO_RANKS, timeout=1200).items():
        assert per_rank == ["ok", "ok"], (name, per_rank)
