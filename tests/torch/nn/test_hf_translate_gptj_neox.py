"""smp.torch.nn.huggingface.gptj / .gptneox: SMP v1's names, exact round trips, and the right numbers.

From tiny configs in one process: Hugging Face -> SMP v1 -> Hugging Face gives back every tensor
bit for bit (and the other way round) and loads strictly into the Hugging Face model; GPT-NeoX's
per-head fused query_key_value split into query/key/value gives ``GPTNeoXAttention``'s output; a
plain-torch forward of SMP v1's structure (parallel residual, SMP v1's names) over a translated
state dict gives the Hugging Face logits, so every name lands in its role; the generic dispatch
recognises both families; the hook getters return SMP v1's three hooks (what they compute:
test_hf_gptj_neox_hooks.py); bad input fails naming what is wrong.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from smp.torch.nn.huggingface import (  # noqa: E402
    HFTranslationError,
    family_of_state_dict,
    gptj,
    gptneox,
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf,
)
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402
from transformers.models.gptj import modeling_gptj  # noqa: E402

VOCAB, S, HIDDEN, HEADS = 40, 7, 16, 4


def _gptj(**over: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPTJConfig(**{"vocab_size": VOCAB, "n_embd": HIDDEN, "n_layer": 2, "n_head": HEADS,
                                     "n_positions": 16, "rotary_dim": 2, "n_inner": 24, "resid_pdrop": 0.0,
                                     "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.2,
                                     "bos_token_id": 0, "eos_token_id": 0, **over})
    return transformers.GPTJForCausalLM(cfg).eval()


def _neox(**over: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(**{"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2,
                                        "num_attention_heads": HEADS, "intermediate_size": 24,
                                        "max_position_embeddings": 16, "initializer_range": 0.2, **over})
    model = transformers.GPTNeoXForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make every tensor distinct
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, S), generator=torch.Generator().manual_seed(3))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:6]
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def _layer_names(prefix: str, table: dict[str, tuple[str, ...]]) -> set[str]:
    return {f"{prefix}{owner}.{leaf}" for owner, leaves in table.items() for leaf in leaves}


# --- SMP v1's names and exact round trips -------------------------------------------------------

def test_gptj_names_are_smp_v1s_and_round_trips_are_exact() -> None:
    model = _gptj()
    hf = model.state_dict()
    smd = gptj.translate_hf_state_dict_to_smdistributed_gptj(hf)
    per_layer = {"pre_layernorm": ("weight", "bias"), "attention.query": ("weight",), "attention.key": ("weight",),
                 "attention.value": ("weight",), "attention.dense": ("weight",),
                 "output.dense1": ("weight", "bias"), "output.dense2": ("weight", "bias")}
    expected = {"word_embedding.weight", "layernorm.weight", "layernorm.bias", "lm_head.weight", "lm_head.bias"}
    for n in range(2):
        expected |= _layer_names(f"transformer.seq_layers.{n}.", per_layer)
    assert set(smd) == expected
    assert torch.equal(smd["transformer.seq_layers.1.attention.query.weight"], hf["transformer.h.1.attn.q_proj.weight"])
    assert torch.equal(smd["transformer.seq_layers.0.pre_layernorm.bias"], hf["transformer.h.0.ln_1.bias"])
    back = gptj.translate_state_dict_to_hf_gptj(smd, max_seq_len=16)
    _assert_same(back, hf)
    _assert_same(gptj.translate_hf_state_dict_to_smdistributed_gptj(back), smd)
    _assert_same(gptj.translate_hf_gptj_state_dict_to_smdistributed(hf, 16), smd)  # SMP v1's older name
    other = _gptj()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(back, strict=True)
    torch.testing.assert_close(other(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=0, atol=0)


@pytest.mark.parametrize("over", [{}, {"attention_bias": False}, {"tie_word_embeddings": True},
                                  {"use_parallel_residual": False}], ids=["default", "no-bias", "tied", "sequential"])
def test_gptneox_names_are_smp_v1s_and_round_trips_are_exact(over: dict[str, Any]) -> None:
    model = _neox(**over)
    hf = model.state_dict()
    smd = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(hf, num_attention_heads=HEADS)
    bias = ("weight", "bias") if over.get("attention_bias", True) else ("weight",)
    per_layer = {"attention.pre_layernorm": ("weight", "bias"), "output.pre_layernorm": ("weight", "bias"),
                 "attention.query": bias, "attention.key": bias, "attention.value": bias, "attention.dense": bias,
                 "output.dense1": ("weight", "bias"), "output.dense2": ("weight", "bias")}
    expected = {"word_embedding.weight", "layernorm.weight", "layernorm.bias", "lm_head.weight"}
    for n in range(2):
        expected |= _layer_names(f"transformer.seq_layers.{n}.", per_layer)
    assert set(smd) == expected
    assert torch.equal(smd["transformer.seq_layers.0.output.pre_layernorm.weight"],
                       hf["gpt_neox.layers.0.post_attention_layernorm.weight"])
    back = gptneox.translate_state_dict_to_hf_gptneox(smd, max_seq_len=16, num_attention_heads=HEADS)
    _assert_same(back, hf)
    _assert_same(gptneox.translate_hf_state_dict_to_smdistributed_gptneox(back, HEADS), smd)
    other = transformers.GPTNeoXForCausalLM(model.config).eval()
    other.load_state_dict(back, strict=True)
    torch.testing.assert_close(other(input_ids=_ids()).logits, model(input_ids=_ids()).logits, rtol=0, atol=0)


def test_gptneox_reads_transformers_4_names_and_buffers() -> None:
    hf = _neox().state_dict()
    old = {("embed_out.weight" if k == "lm_head.weight" else k): v for k, v in hf.items()}
    inv_freq = torch.rand(1)
    old["gpt_neox.layers.1.attention.rotary_emb.inv_freq"] = inv_freq
    old["gpt_neox.layers.1.attention.bias"] = torch.ones(1, 1, 16, 16, dtype=torch.bool)
    old["gpt_neox.layers.1.attention.masked_bias"] = torch.tensor(-1e9)
    smd = gptneox.translate_hf_gptneox_state_dict_to_smdistributed(old, 16, num_attention_heads=HEADS)
    assert smd["transformer.seq_layers.1.attention.rotary_emb.inv_freq"] is inv_freq  # SMP v1's name
    assert torch.equal(smd["lm_head.weight"], hf["lm_head.weight"])
    back = gptneox.translate_state_dict_to_hf_gptneox(smd, num_attention_heads=HEADS)
    assert back.pop("gpt_neox.layers.1.attention.rotary_emb.inv_freq") is inv_freq
    _assert_same(back, hf)  # causal-mask buffers dropped, the head under transformers 5's name


def test_split_query_key_value_is_per_head() -> None:
    d, heads = 3, 2
    fused = torch.arange(3 * heads * d * 5, dtype=torch.float32).view(3 * heads * d, 5)
    q, k, v = gptneox.split_query_key_value(fused, heads)
    for h in range(heads):
        base = h * 3 * d
        assert torch.equal(q[h * d:(h + 1) * d], fused[base:base + d])
        assert torch.equal(k[h * d:(h + 1) * d], fused[base + d:base + 2 * d])
        assert torch.equal(v[h * d:(h + 1) * d], fused[base + 2 * d:base + 3 * d])
    assert torch.equal(gptneox.fuse_query_key_value(q, k, v, heads), fused)


# --- the split q/k/v and SMP v1's names compute what Hugging Face computes ----------------------

def _causal(n: int) -> torch.Tensor:
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return torch.zeros(1, 1, n, n).masked_fill(~keep, torch.finfo(torch.float32).min)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[N, heads, S, d] each -> [N, S, heads * d], causal."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + _causal(q.shape[-2])
    ctx = F.softmax(scores, dim=-1) @ v
    return ctx.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2)


def _lin(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def _ln(x: torch.Tensor, sd: dict[str, torch.Tensor], name: str, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], sd[f"{name}.weight"], sd[f"{name}.bias"], eps)


def _neox_attention(x: torch.Tensor, sd: dict[str, torch.Tensor], p: str, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    q, k, v = (_heads(_lin(x, sd, f"{p}attention.{n}")) for n in ("query", "key", "value"))
    q, k = modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)
    return _lin(_attend(q, k, v), sd, f"{p}attention.dense")


def test_gptneox_split_query_key_value_gives_the_hf_attention() -> None:
    model = _neox()
    attn = model.gpt_neox.layers[0].attention
    x = torch.randn(2, S, HIDDEN, generator=torch.Generator().manual_seed(1))
    cos, sin = model.gpt_neox.rotary_emb(x, torch.arange(S).unsqueeze(0))
    ref, _ = attn(x, attention_mask=_causal(S), position_embeddings=(cos, sin))
    smd = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(model.state_dict(), num_attention_heads=HEADS)
    torch.testing.assert_close(_neox_attention(x, smd, "transformer.seq_layers.0.", cos, sin), ref,
                               rtol=1e-5, atol=1e-5)
    # the check sees the layout: a plain [q; k; v] split of the same fused tensors gives other numbers
    naive = dict(smd)
    for leaf in ("weight", "bias"):
        fused = model.state_dict()[f"gpt_neox.layers.0.attention.query_key_value.{leaf}"]
        for n, part in zip(("query", "key", "value"), fused.chunk(3, dim=0)):
            naive[f"transformer.seq_layers.0.attention.{n}.{leaf}"] = part
    assert not torch.allclose(_neox_attention(x, naive, "transformer.seq_layers.0.", cos, sin), ref, atol=1e-3)


def _neox_smp_v1_forward(sd: dict[str, torch.Tensor], cfg: Any, rotary: Any, ids: torch.Tensor) -> torch.Tensor:
    """SMP v1's GPT-NeoX structure in plain torch: parallel residual, one LayerNorm per branch."""
    x = F.embedding(ids, sd["word_embedding.weight"])
    cos, sin = rotary(x, torch.arange(ids.shape[1]).unsqueeze(0))
    act = ACT2FN[cfg.hidden_act]
    for n in range(cfg.num_hidden_layers):
        p = f"transformer.seq_layers.{n}."
        a = _neox_attention(_ln(x, sd, f"{p}attention.pre_layernorm", cfg.layer_norm_eps), sd, p, cos, sin)
        h = _ln(x, sd, f"{p}output.pre_layernorm", cfg.layer_norm_eps)
        x = x + a + _lin(act(_lin(h, sd, f"{p}output.dense1")), sd, f"{p}output.dense2")
    return _lin(_ln(x, sd, "layernorm", cfg.layer_norm_eps), sd, "lm_head")


def _gptj_smp_v1_forward(sd: dict[str, torch.Tensor], cfg: Any, rotary: Any, ids: torch.Tensor) -> torch.Tensor:
    """SMP v1's GPT-J structure in plain torch: one LayerNorm, attention and MLP on one residual."""
    x = F.embedding(ids, sd["word_embedding.weight"])
    sin, cos = rotary(x, torch.arange(ids.shape[1]).unsqueeze(0))
    act, r = ACT2FN[cfg.activation_function], cfg.rotary_dim
    for n in range(cfg.n_layer):
        p = f"transformer.seq_layers.{n}."
        h = _ln(x, sd, f"{p}pre_layernorm", cfg.layer_norm_epsilon)
        q, k, v = (_lin(h, sd, f"{p}attention.{m}").view(*h.shape[:2], HEADS, -1) for m in ("query", "key", "value"))
        q, k = (torch.cat([modeling_gptj.apply_rotary_pos_emb(t[..., :r], sin, cos), t[..., r:]], dim=-1)
                for t in (q, k))
        a = _lin(_attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)), sd, f"{p}attention.dense")
        x = x + a + _lin(act(_lin(h, sd, f"{p}output.dense1")), sd, f"{p}output.dense2")
    return _lin(_ln(x, sd, "layernorm", cfg.layer_norm_epsilon), sd, "lm_head")


def test_translated_state_dicts_give_the_hf_logits_in_smp_v1s_structure() -> None:
    ids = _ids()
    j = _gptj()
    smd = gptj.translate_hf_state_dict_to_smdistributed_gptj(j.state_dict())
    torch.testing.assert_close(_gptj_smp_v1_forward(smd, j.config, j.transformer.rotary_emb, ids),
                               j(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    neox = _neox()
    smd = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(neox.state_dict(), num_attention_heads=HEADS)
    torch.testing.assert_close(_neox_smp_v1_forward(smd, neox.config, neox.gpt_neox.rotary_emb, ids),
                               neox(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # swapping the two LayerNorms' roles is seen (they are distinct tensors)
    swapped = dict(smd)
    for n in range(2):
        a, b = f"transformer.seq_layers.{n}.attention.pre_layernorm.", f"transformer.seq_layers.{n}.output.pre_layernorm."
        for leaf in ("weight", "bias"):
            swapped[a + leaf], swapped[b + leaf] = smd[b + leaf], smd[a + leaf]
    assert not torch.allclose(_neox_smp_v1_forward(swapped, neox.config, neox.gpt_neox.rotary_emb, ids),
                              neox(input_ids=ids).logits, atol=1e-3)


# --- the package's dispatch ---------------------------------------------------------------------

def test_generic_translate_recognises_gptj_and_gptneox() -> None:
    j = _gptj().state_dict()
    n = _neox().state_dict()
    smd_j = translate_hf_state_dict_to_smdistributed(j)
    _assert_same(smd_j, gptj.translate_hf_state_dict_to_smdistributed_gptj(j))
    assert family_of_state_dict(smd_j, hf=False) == "gptj"  # not GPT-2, not GPT-NeoX (it has lm_head.weight)
    _assert_same(translate_state_dict_to_hf(smd_j), j)
    smd_n = translate_hf_state_dict_to_smdistributed(n, num_attention_heads=HEADS)
    _assert_same(smd_n, gptneox.translate_hf_state_dict_to_smdistributed_gptneox(n, HEADS))
    assert family_of_state_dict(smd_n, hf=False) == "gptneox"
    _assert_same(translate_state_dict_to_hf(smd_n, num_attention_heads=HEADS), n)
    _assert_same(translate_state_dict_to_hf(smd_n, model_type="gpt_neox", num_attention_heads=HEADS), n)
    _assert_same(translate_hf_state_dict_to_smdistributed(j, model_type="gptj"), smd_j)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2,
                                                                n_positions=8))
    assert family_of_state_dict(translate_hf_state_dict_to_smdistributed(gpt2.state_dict()), hf=False) == "gpt2"


# --- hook getters and bad input ------------------------------------------------------------------------

def test_hook_getters_return_smp_v1s_three_hooks() -> None:
    # what the hooks compute is tested in test_hf_gptj_neox_hooks.py
    assert [h.__name__ for h in gptj.get_hf_gptj_transformer_hooks()] == [
        "hf_gptj_transformer_init_hook", "hf_gptj_transformer_forward_hook", "hf_gptj_transformer_return_hook"]
    assert [h.__name__ for h in gptneox.get_hf_gptneox_transformer_lm_head_hooks()] == [
        "hf_gptneox_transformer_init_hook", "hf_gptneox_transformer_forward_hook",
        "hf_gptneox_transformer_return_hook"]


def test_bad_input_is_named() -> None:
    j = _gptj().state_dict()
    n = _neox().state_dict()
    with pytest.raises(HFTranslationError, match="partial state dict"):
        gptj.translate_state_dict_to_hf_gptj({"_smp_is_partial": True})
    with pytest.raises(HFTranslationError, match="partial state dict"):
        gptneox.translate_hf_state_dict_to_smdistributed_gptneox({"_smp_is_partial": True}, HEADS)
    with pytest.raises(HFTranslationError, match="'module.transformer.wte.weight'"):
        gptj.translate_hf_state_dict_to_smdistributed_gptj({"module." + k: v for k, v in j.items()})
    with pytest.raises(HFTranslationError, match="Fix: pass num_attention_heads=config.num_attention_heads"):
        gptneox.translate_hf_state_dict_to_smdistributed_gptneox(n)
    with pytest.raises(HFTranslationError, match="num_attention_heads=5 does not divide"):
        gptneox.translate_hf_state_dict_to_smdistributed_gptneox(n, num_attention_heads=5)
    smd = gptneox.translate_hf_state_dict_to_smdistributed_gptneox(n, HEADS)
    with pytest.raises(HFTranslationError, match="Fix: pass num_attention_heads"):
        gptneox.translate_state_dict_to_hf_gptneox(smd)
    smd.pop("transformer.seq_layers.1.attention.value.bias")
    with pytest.raises(HFTranslationError, match="query, key and value together"):
        gptneox.translate_state_dict_to_hf_gptneox(smd, num_attention_heads=HEADS)
    with pytest.raises(HFTranslationError, match="max_seq_len=0"):
        gptj.translate_state_dict_to_hf_gptj({}, max_seq_len=0)
    # SMP v1's GPT-J output LayerNorms have no GPT-J counterpart: dropped on the way back, as SMP v1 did
    smd_j = gptj.translate_hf_state_dict_to_smdistributed_gptj(j)
    extra = {"transformer.seq_layers.0.output.layernorm.weight": torch.ones(HIDDEN),
             "transformer.seq_layers.1.output.pre_layernorm.bias": torch.zeros(HIDDEN)}
    _assert_same(gptj.translate_state_dict_to_hf_gptj({**smd_j, **extra}), j)
    with pytest.raises(HFTranslationError, match="'transformer.seq_layers.0.attention.rotary.weight'"):
        gptj.translate_state_dict_to_hf_gptj({**smd_j, "transformer.seq_layers.0.attention.rotary.weight": 1})


@pytest.mark.parametrize("module", [gptj, gptneox], ids=["gptj", "gptneox"])
def test_docstring_examples_run(module: Any) -> None:
    import doctest

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
