"""smp.torch.nn.huggingface: exact round trips, and the SMP v1 structure computes what the HF model does.

Per family (GPT-2, BERT, RoBERTa), from a tiny config in one process: Hugging Face -> SMP v1 ->
Hugging Face gives back every tensor bit for bit (and the other way round), a translated Hugging
Face state dict loaded into smp's own module gives the Hugging Face model's logits / hidden states,
and bad input fails naming what is wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from smp.torch.nn import DistributedTransformer, DistributedTransformerLMHead  # noqa: E402
from smp.torch.nn.huggingface import (  # noqa: E402
    FAMILIES,
    HFTranslationError,
    bert,
    gpt2,
    roberta,
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf,
)

VOCAB, S = 40, 7


def _gpt2_config(**over: Any) -> Any:
    # initializer_range 0.5: activations large enough that e.g. erf-GELU vs tanh-GELU shows
    return transformers.GPT2Config(**{"vocab_size": VOCAB, "n_embd": 16, "n_layer": 2, "n_head": 4,
                                      "n_positions": 16, "n_inner": 24, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                      "attn_pdrop": 0.0, "initializer_range": 0.5, **over})


def _encoder_config(kind: str) -> Any:
    cls = transformers.BertConfig if kind == "bert" else transformers.RobertaConfig
    return cls(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
               max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
               pad_token_id=1, initializer_range=0.5)


def _gpt2(**over: Any) -> Any:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_gpt2_config(**over)).eval()


def _encoder_model(kind: str) -> Any:
    torch.manual_seed(0)
    cls = transformers.BertForMaskedLM if kind == "bert" else transformers.RobertaForMaskedLM
    return cls(_encoder_config(kind)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(2, VOCAB, (3, S), generator=torch.Generator().manual_seed(3))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:6]
    for k in a:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


# --- round trips -------------------------------------------------------------------------------

def test_gpt2_round_trips_are_exact() -> None:
    hf = _gpt2().state_dict()
    smd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf)
    assert "transformer.seq_layers.1.attention.query.weight" in smd and "layernorm.bias" in smd
    _assert_same(gpt2.translate_state_dict_to_hf_gpt2(smd, max_seq_len=16), hf)
    # and from smp's side: a freshly initialised SMP v1 module's state dict survives HF and back
    native = gpt2.GPT2DistributedTransformerLMHead(_gpt2_config()).state_dict()
    _assert_same(gpt2.translate_hf_state_dict_to_smdistributed_gpt2(gpt2.translate_state_dict_to_hf_gpt2(native)),
                 native)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_encoder_round_trips_are_exact(kind: str) -> None:
    module = bert if kind == "bert" else roberta
    to_smd = getattr(module, f"translate_hf_state_dict_to_smdistributed_{kind}")
    to_hf = getattr(module, f"translate_state_dict_to_hf_{kind}")
    hf = _encoder_model(kind).state_dict()
    smd = to_smd(hf)
    assert f"{kind}.encoder.seq_layers.0.output.dense1.weight" in smd
    assert not any(".encoder.layer." in k for k in smd)
    _assert_same(to_hf(smd), hf)
    _assert_same(to_smd(to_hf(smd)), smd)


@pytest.mark.parametrize("kind", ["bert", "gpt2", "roberta"])  # GPT-J, GPT-NeoX: test_hf_translate_gptj_neox.py
def test_generic_translate_recognises_each_family(kind: str) -> None:
    hf = _gpt2().state_dict() if kind == "gpt2" else _encoder_model(kind).state_dict()
    smd = translate_hf_state_dict_to_smdistributed(hf)
    _assert_same(smd, FAMILIES[kind].to_smdistributed(hf))
    _assert_same(translate_state_dict_to_hf(smd), hf)
    _assert_same(translate_state_dict_to_hf(smd, model_type=kind), hf)


def test_gpt2_layer_translation_keeps_the_rest() -> None:
    hf = _gpt2().state_dict()
    layered = gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer(hf)
    assert "transformer.h.0.attention.query.weight" in layered and "transformer.wte.weight" in layered
    _assert_same(gpt2.translate_state_dict_to_hf_gpt2_layer(layered), hf)
    hooked = {k.replace("transformer.h.0.", "transformer.h.0.module."): v for k, v in layered.items()}
    _assert_same(gpt2.translate_state_dict_to_hf_gpt2_layer(hooked), hf)  # earlier smp versions' spelling


# --- the SMP v1 structure computes what the Hugging Face model computes ------------------------

def test_translated_gpt2_in_smp_lm_head_gives_the_hf_logits() -> None:
    hf = _gpt2()
    ids = _ids()
    pad = torch.ones_like(ids)
    pad[0, -2:] = 0
    ref = hf(input_ids=ids, attention_mask=pad, labels=ids)
    _, kwargs = gpt2.hf_gpt2_transformer_lm_head_init_hook(hf.config)
    lm = DistributedTransformerLMHead(**kwargs).eval()
    lm.load_state_dict(gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf.state_dict()))
    loss, logits = lm((ids, 1 - pad, None, None, ids))  # SMP v1's tuple: 1 = masked
    keep = pad.bool()  # a padded query position's output is not defined the same way in both
    torch.testing.assert_close(logits[keep], ref.logits[keep], rtol=1e-5, atol=1e-5)
    nopad = hf(input_ids=ids, labels=ids)
    loss, logits = lm((ids, None, None, None, ids))
    torch.testing.assert_close(logits, nopad.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, nopad.loss, rtol=1e-5, atol=1e-6)
    # the converted model takes the Hugging Face call and returns its output type
    conv = gpt2.GPT2DistributedTransformerLMHead.from_hf(hf)
    out = conv(input_ids=ids, labels=ids)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    torch.testing.assert_close(out.logits, nopad.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, nopad.loss, rtol=1e-5, atol=1e-6)
    # the Hugging Face padding mask as int or bool gives the same
    by_int = conv(input_ids=ids, attention_mask=pad).logits
    by_bool = conv(input_ids=ids, attention_mask=pad.bool()).logits
    torch.testing.assert_close(by_bool, by_int)
    torch.testing.assert_close(by_int[keep], ref.logits[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_translated_encoder_in_smp_transformer_gives_the_hf_outputs(kind: str) -> None:
    hf = _encoder_model(kind)
    ids = _ids()
    pad = torch.ones_like(ids)
    pad[1, -3:] = 0
    ref = hf(input_ids=ids, attention_mask=pad).logits
    base = getattr(hf, kind)
    _, kwargs = bert.hf_bert_transformer_init_hook(hf.config)
    stack = DistributedTransformer(**kwargs).eval()
    smd = translate_hf_state_dict_to_smdistributed(hf.state_dict())
    prefix = f"{kind}.encoder."
    stack.load_state_dict({k[len(prefix):]: v for k, v in smd.items() if k.startswith(prefix)})
    hidden = base.embeddings(input_ids=ids)
    mask = ((1 - pad).float() * -10000.0).view(3, 1, 1, S)
    ref_hidden = base.encoder(hidden, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(stack((hidden, mask))[0], ref_hidden, rtol=1e-5, atol=1e-5)
    # the whole model with its encoder replaced by the converted one (as DistributedModel does)
    base.encoder = bert.BertDistributedTransformer.from_hf(base.encoder).eval()
    assert len(base.encoder.seq_layers) == 2
    torch.testing.assert_close(hf(input_ids=ids, attention_mask=pad).logits, ref, rtol=1e-5, atol=1e-5)


def test_gpt2_layer_hooks_give_the_hf_block_output() -> None:
    from smp.torch.nn import DistributedTransformerLayer

    hf = _gpt2()
    block = hf.transformer.h[0]
    init, forward, back = gpt2.get_hf_gpt2_transformer_layer_hooks()
    args, kwargs = init(hf.config, layer_idx=0)
    layer = DistributedTransformerLayer(*args, **kwargs).eval()
    sd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2_layer({"h.0." + k: v for k, v in block.state_dict().items()})
    layer.load_state_dict({k[len("h.0."):]: v for k, v in sd.items()})
    x = torch.randn(2, S, 16, generator=torch.Generator().manual_seed(1))
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool)).view(1, 1, S, S)
    additive = torch.zeros(1, 1, S, S).masked_fill(~causal, torch.finfo(torch.float32).min)
    ref = block(x, attention_mask=additive)
    (inputs,), _ = forward(x, attention_mask=causal)
    torch.testing.assert_close(back(layer(inputs)), ref, rtol=1e-5, atol=1e-5)


# --- bad input ---------------------------------------------------------------------------------

def test_bad_input_is_named() -> None:
    hf = _gpt2().state_dict()
    with pytest.raises(HFTranslationError, match="lm_head.weight differs"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2({**hf, "lm_head.weight": hf["lm_head.weight"] + 1})
    with pytest.raises(HFTranslationError, match="'module.transformer.wte.weight'"):
        gpt2.translate_hf_state_dict_to_smdistributed_gpt2({"module." + k: v for k, v in hf.items()})
    with pytest.raises(HFTranslationError, match="partial state dict"):
        gpt2.translate_state_dict_to_hf_gpt2({"_smp_is_partial": True})
    with pytest.raises(HFTranslationError, match="max_seq_len=0"):
        gpt2.translate_state_dict_to_hf_gpt2({}, max_seq_len=0)
    smd = gpt2.translate_hf_state_dict_to_smdistributed_gpt2(hf)
    smd.pop("transformer.seq_layers.0.attention.key.weight")
    with pytest.raises(HFTranslationError, match="query, key and value together"):
        gpt2.translate_state_dict_to_hf_gpt2(smd)
    with pytest.raises(HFTranslationError, match="model_type='llama'.*'bert', 'gpt2', 'gptj', 'gptneox', 'roberta'"):
        translate_hf_state_dict_to_smdistributed(hf, model_type="llama")
    with pytest.raises(HFTranslationError, match="no family recognised"):
        translate_state_dict_to_hf({"x.weight": torch.zeros(1)})
    with pytest.raises(HFTranslationError, match="(?s)scale_attn_by_inverse_layer_idx=True.*tie_word_embeddings=False"):
        gpt2.GPT2DistributedTransformerLMHead(_gpt2_config(scale_attn_by_inverse_layer_idx=True,
                                                           tie_word_embeddings=False))
    conv = gpt2.GPT2DistributedTransformerLMHead.from_hf(_gpt2())
    with pytest.raises(HFTranslationError, match=r"does not take \['past_key_values'\]"):
        conv(input_ids=_ids(), past_key_values=object())
    assert issubclass(HFTranslationError, ValueError)
