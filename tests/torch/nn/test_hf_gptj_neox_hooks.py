"""SMP v1's GPT-J / GPT-NeoX hooks: registered, a Hugging Face model becomes `DistributedTransformerLMHead`
with rotary embeddings and the parallel residual, and computes what the Hugging Face model computes.

One process (tp=1): ``smp.tp_register_with_module(cls, DistributedTransformerLMHead, *hooks)``, the
model created inside ``smp.tensor_parallelism()`` and replaced, a translated Hugging Face state dict
loaded: logits, loss (with a right-padding mask too) and every parameter's gradient (translated back
to Hugging Face names) equal the Hugging Face model's, for GPT-J and four GPT-NeoX configs
(parallel and sequential residual, no biases, full rotary). At tp=2 through ``smp.DistributedModel``
the same holds on each rank. The rotary helper equals each family's own; without the registration
a marked GPT-NeoX keeps the Hugging Face structure; bad configs and calls fail naming the problem.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip("transformers")

from smp.torch.nn import DistributedTransformerLMHead  # noqa: E402
from smp.torch.nn.huggingface import HFTranslationError, gptj, gptneox  # noqa: E402
from smp.torch.nn.rotary import apply_rotary, rotary_sin_cos  # noqa: E402

VOCAB, S, HEADS = 64, 9, 4


def _config(kind: str, **over: Any) -> Any:
    if kind == "gptj":
        return transformers.GPTJConfig(**{"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": HEADS,
                                          "n_positions": 16, "rotary_dim": 4, "n_inner": 48, "resid_pdrop": 0.0,
                                          "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0,
                                          "eos_token_id": 0, **over})
    return transformers.GPTNeoXConfig(**{"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                                         "num_attention_heads": HEADS, "intermediate_size": 48,
                                         "max_position_embeddings": 16, **over})


def _family(kind: str) -> tuple[Any, tuple[Any, Any, Any], Any, Any]:
    """(HF class, hooks, to SMP v1 names, to HF names)."""
    if kind == "gptj":
        return (transformers.GPTJForCausalLM, gptj.get_hf_gptj_transformer_hooks(),
                gptj.translate_hf_state_dict_to_smdistributed_gptj, gptj.translate_state_dict_to_hf_gptj)
    return (transformers.GPTNeoXForCausalLM, gptneox.get_hf_gptneox_transformer_lm_head_hooks(),
            lambda sd: gptneox.translate_hf_state_dict_to_smdistributed_gptneox(sd, HEADS),
            lambda sd: gptneox.translate_state_dict_to_hf_gptneox(sd, num_attention_heads=HEADS))


def _reference(kind: str, cfg: Any) -> Any:
    torch.manual_seed(0)
    model = _family(kind)[0](cfg).eval()
    with torch.no_grad():  # HF initialises biases and LayerNorms to constants: make every tensor distinct
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, S), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    return ids, mask


@contextmanager
def _marked(kind: str, cfg: Any) -> Iterator[Any]:
    """The model as a user writes it: the hooks registered, the model created inside
    smp.tensor_parallelism(); the registration is dropped on leaving."""
    import smp.torch as smp
    from smp.torch.tp.registry import REGISTRY

    cls, hooks, _, _ = _family(kind)
    smp.tp_register_with_module(cls, DistributedTransformerLMHead, *hooks)
    try:
        with smp.tensor_parallelism():
            model = cls(cfg)
        yield model
    finally:
        del REGISTRY[cls]


def _hf_grads(grads: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Our gradients under Hugging Face names."""
    return _family(kind)[3](grads)


CASES = [("gptj", {}), ("gptneox", {}), ("gptneox", {"use_parallel_residual": False}),
         ("gptneox", {"attention_bias": False, "rotary_pct": 1.0})]
IDS = ["gptj", "neox", "neox-sequential", "neox-nobias-fullrotary"]


@pytest.mark.parametrize(("kind", "over"), CASES, ids=IDS)
def test_registered_hooks_give_the_hf_logits_loss_and_gradients(kind: str, over: dict[str, Any]) -> None:
    from smp.torch.tp.marking import apply_tensor_parallelism

    cfg = _config(kind, **over)
    ref = _reference(kind, cfg)
    with _marked(kind, cfg) as marked:
        model = apply_tensor_parallelism(marked)
    inner = model
    assert isinstance(inner, DistributedTransformerLMHead) and len(inner.transformer.seq_layers) == 2
    assert inner.position_embedding is None and inner.lm_head is not None
    model.load_state_dict(_family(kind)[2](ref.state_dict()))  # SMP v1's names, no prefix
    model.eval()
    ids, mask = _data()
    want, got = ref(input_ids=ids, attention_mask=mask, labels=ids), model(input_ids=ids, attention_mask=mask,
                                                                         labels=ids)
    assert type(got).__name__ == "CausalLMOutputWithPast"
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    grads = _hf_grads({n: p.grad for n, p in model.named_parameters()}, kind)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    unmasked = model(input_ids=ids).logits  # the padding mask is applied (row 1's padded keys)
    assert not torch.allclose(unmasked[1, -2:], got.logits[1, -2:], atol=1e-4)


def _tp2(kind: str, over: dict[str, Any]) -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True, "comm_timeout": 60.0})
    cfg = _config(kind, **over)
    ref = _reference(kind, cfg)
    ids, mask = _data()
    want = ref(input_ids=ids, attention_mask=mask, labels=ids)
    want.loss.backward()
    with _marked(kind, cfg) as marked:
        model = smp.DistributedModel(marked)
    inner = model.get_module()
    assert isinstance(inner, DistributedTransformerLMHead)
    assert inner.transformer.seq_layers[0].attention.query.weight.shape == (16, 32), "heads split over 2 ranks"
    assert inner.lm_head.weight.shape == (VOCAB // 2, 32), "the untied head split over the vocabulary"
    model.load_state_dict(_family(kind)[2](ref.state_dict()))  # SMP v1's names, no prefix

    @smp.step
    def step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out.loss)
        return out.loss, out.logits

    loss, logits = step(model, ids, mask)
    torch.testing.assert_close(loss.reduce_mean(), want.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.concat(), want.logits.detach(), rtol=1e-4, atol=1e-5)
    grads = _hf_grads(full_state_dict(model.get_module(), smp.get_tp_process_group(), grads=True), kind)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return kind


@pytest.mark.parametrize(("kind", "over"), CASES[:2], ids=IDS[:2])
def test_registered_hooks_at_tp2_match_the_hf_model(kind: str, over: dict[str, Any]) -> None:
    assert run_ranks(_tp2, 2, args=(kind, over), timeout=110) == [kind, kind]


def test_rotary_matches_each_familys_own() -> None:
    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.gptj import modeling_gptj

    q = torch.randn(2, HEADS, S, 8, generator=torch.Generator().manual_seed(4))
    # GPT-J: interleaved pairs on the first rotary_dim dims ([N, S, heads, d] layout there)
    table = modeling_gptj.create_sinusoidal_positions(S, 4)[None]
    sin_j, cos_j = table.split(2, dim=-1)
    rot = modeling_gptj.apply_rotary_pos_emb(q.transpose(1, 2)[..., :4], sin_j, cos_j)
    want_j = torch.cat([rot, q.transpose(1, 2)[..., 4:]], dim=-1).transpose(1, 2)
    sin, cos = rotary_sin_cos(S, 4, 10000.0, interleaved=True)
    torch.testing.assert_close(apply_rotary(q, sin, cos, True), want_j, rtol=1e-6, atol=1e-6)
    # GPT-NeoX: halves
    cfg = _config("gptneox", rotary_pct=0.5, rotary_emb_base=500.0)
    cos_n, sin_n = modeling_gpt_neox.GPTNeoXRotaryEmbedding(cfg)(q, torch.arange(S)[None])
    want_n, _ = modeling_gpt_neox.apply_rotary_pos_emb(q, q, cos_n, sin_n)
    sin, cos = rotary_sin_cos(S, 4, 500.0, interleaved=False)
    torch.testing.assert_close(apply_rotary(q, sin, cos, False), want_n, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(apply_rotary(q, sin, cos, True), want_n, atol=1e-3), "the two styles differ"


def test_plain_marking_keeps_the_hf_structure_without_the_registration() -> None:
    import smp.torch as smp
    from smp.torch.tp.marking import apply_tensor_parallelism

    with smp.tensor_parallelism():
        model = transformers.GPTNeoXForCausalLM(_config("gptneox"))
    assert type(apply_tensor_parallelism(model)).__name__ == "GPTNeoXForCausalLM"


def test_defaults_keep_the_gpt2_structure() -> None:
    lm = DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                      intermediate_size=16, vocab_size=20, num_positions=6)
    names = set(lm.state_dict())
    assert "position_embedding.weight" in names and not any(k.startswith("lm_head.") for k in names)
    assert "transformer.seq_layers.0.attention.query.bias" in names
    assert lm.transformer.seq_layers[0].attention.rotary_dim is None


def test_bad_configs_options_and_calls_are_named() -> None:
    init_j, forward_j, _ = gptj.get_hf_gptj_transformer_hooks()
    with pytest.raises(HFTranslationError, match=r"(?s)rotary_dim=3.*tie_word_embeddings=True.*Fix"):
        init_j(_config("gptj", rotary_dim=3, tie_word_embeddings=True))
    init_n, forward_n, _ = gptneox.get_hf_gptneox_transformer_lm_head_hooks()
    with pytest.raises(HFTranslationError, match=r"(?s)hidden_act='silu'.*rope_type='linear'"):
        init_n(_config("gptneox", rope_scaling={"rope_type": "linear", "factor": 2.0}, hidden_act="silu"))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(HFTranslationError, match=r"does not take \['token_type_ids', 'use_cache'\]"):
        forward_j(ids, token_type_ids=ids, use_cache=True)
    with pytest.raises(HFTranslationError, match=r"does not take \['inputs_embeds'\]"):
        forward_n(ids, inputs_embeds=torch.zeros(1, 3, 8))
    (inputs,), _ = forward_n(ids, attention_mask=torch.tensor([[1, 1, 0]]), labels=ids, return_dict=True)
    assert inputs[1].tolist() == [[0, 0, 1]]  # SMP v1's mask: 1 = masked
    with pytest.raises(ValueError, match="single_pre_layernorm=True needs parallel_attn_output=True"):
        DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                     intermediate_size=16, vocab_size=20, single_pre_layernorm=True)
    with pytest.raises(ValueError, match="rotary_dim=3"):
        DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                     intermediate_size=16, vocab_size=20, rotary_dim=3)
    with pytest.raises(ValueError, match="tie_input_output_embedding=False"):
        DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                     intermediate_size=16, vocab_size=20, use_lm_head_bias=True)
    rotary = DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                          intermediate_size=16, vocab_size=20, use_positional_embedding=False,
                                          rotary_dim=4)
    with pytest.raises(ValueError, match="position_ids other than 0 .. S-1"):
        rotary((ids, None, None, torch.tensor([[1, 2, 3]]), None))
    rotary((ids, None, None, torch.arange(3)[None], None))  # the default positions are accepted


def test_smp_v1_neox_rotary_buffer_is_accepted_on_load() -> None:
    """SMP v1's GPT-NeoX state dicts (transformers 4.x) carry attention.rotary_emb.inv_freq: a strict
    load takes them, as the table is recomputed from rotary_dim."""
    _, kwargs = gptneox.hf_gptneox_transformer_init_hook(_config("gptneox"))
    lm = DistributedTransformerLMHead(**kwargs)
    sd = {**lm.state_dict(), "transformer.seq_layers.1.attention.rotary_emb.inv_freq": torch.rand(1)}
    lm.load_state_dict(sd, strict=True)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"transformer.seq_layers.1.attention.rotary_emb"):
        DistributedTransformerLMHead(**{**kwargs, "rotary_dim": None}).load_state_dict(sd, strict=True)
