"""The SMP v1 path for a Hugging Face GPT-2: marked under tp=2, it becomes SMP v1's structure and trains
like one process.

``smp.model_creation(tensor_parallelism=True)`` around ``AutoModelForCausalLM.from_config`` (what
SMP v1's ``train_gpt_simple.py`` writes), then ``smp.DistributedModel`` at tp=2 x pp=1, and at tp=2 x
pp=2 with the second layer on partition 1 and each layer checkpointed: the module is
a `DistributedTransformerLMHead` with ``transformer.seq_layers``; each rank's loss per step equals the
one-process Hugging Face model's on the TP group's combined batch; ``model.state_dict()`` translated to
Hugging Face names equals the one-process model's parameters; a Hugging Face state dict translated
the other way loads back; ``model.save_pretrained`` writes a checkpoint plain transformers loads.
A marked BERT / RoBERTa masked LM at tp=2 has SMP v1's encoder and the Hugging Face loss, logits and
gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 3
VOCAB = 64


def _config() -> Any:
    return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16, n_inner=48,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(7))


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = _data()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _train(path: str, pp: int) -> dict[str, Any]:
    import smp.torch as smp
    from smp.torch.nn import DistributedTransformerLMHead
    from smp.torch.nn.huggingface.gpt2 import (
        translate_hf_state_dict_to_smdistributed_gpt2,
        translate_state_dict_to_hf_gpt2,
    )

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": pp, "ddp": True, "microbatches": pp,
              "auto_partition": False, "default_partition": 0, "comm_timeout": 60.0})
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=torch.float32, fused_softmax=True,
                            attention_in_fp32=False):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    model = smp.DistributedModel(model)
    m = model.get_module()
    assert isinstance(m, DistributedTransformerLMHead), type(m)
    assert len(m.transformer.seq_layers) == 2  # what SMP v1 scripts read
    if pp > 1:  # as SMP v1 scripts split it, with each layer checkpointed
        smp.set_partition(m.transformer.seq_layers[1], 1)
        for layer in m.transformer.seq_layers:
            smp.set_activation_checkpointing(layer)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    ids = _data().chunk(smp.dp_size())[smp.dp_rank()]  # SMP v1: per-rank batches (prescaled_batch False)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(train_step(model, ids).reduce_mean().item())
        opt.step()
    full = model.state_dict()  # under pipelining only global rank 0 gets the entries (SMP v1)
    hf_state = translate_state_dict_to_hf_gpt2(full, max_seq_len=16) if full else None
    # a Hugging Face state dict translated to SMP v1 names loads into the distributed model
    torch.manual_seed(5)
    other = transformers.AutoModelForCausalLM.from_config(_config())
    model.load_state_dict(translate_hf_state_dict_to_smdistributed_gpt2(other.state_dict()))
    with torch.no_grad():
        @smp.step
        def logits_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
            return model(input_ids=ids).logits

        loaded = logits_step(model, ids).concat()
    want = other(input_ids=ids).logits.detach()
    torch.testing.assert_close(loaded, want, rtol=1e-5, atol=1e-5)
    model.save_pretrained(path)
    return {"losses": losses, "hf_state": hf_state, "ids": ids, "want": want}


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "tp2-pp2"])
def test_marked_gpt2_trains_like_one_process_and_translates(tmp_path: Any, pp: int) -> None:
    ref_losses, ref_state = _reference()
    results = run_ranks(_train, 2 * pp, args=(str(tmp_path), pp), timeout=110)
    for rank, res in enumerate(results):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, r=rank: f"rank {r}: losses\n{m}")
        if res["hf_state"] is None:
            assert pp > 1 and rank > 0
            continue
        assert sorted(res["hf_state"]) == sorted(ref_state)
        for name, value in ref_state.items():
            torch.testing.assert_close(res["hf_state"][name], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, r=rank, n=name: f"rank {r}: {n}\n{m}")
    # the SMP v1 structure saves a plain Hugging Face checkpoint (of the last loaded weights)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=results[0]["ids"]).logits, results[0]["want"],
                                   rtol=1e-5, atol=1e-5)


def _encoder_config(kind: str) -> Any:
    cls = transformers.BertConfig if kind == "bert" else transformers.RobertaConfig
    return cls(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _masked_lm(kind: str) -> dict[str, Any]:
    """A marked BertForMaskedLM / RobertaForMaskedLM at tp=2: the encoder is SMP v1's
    DistributedTransformer, the loss, logits and every gradient are the Hugging Face model's."""
    import smp.torch as smp
    from smp.torch.nn import DistributedTransformer, full_state_dict
    from smp.torch.nn.huggingface import translate_state_dict_to_hf

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True, "comm_timeout": 60.0})
    cls = transformers.BertForMaskedLM if kind == "bert" else transformers.RobertaForMaskedLM
    torch.manual_seed(0)
    ref = cls(_encoder_config(kind))
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    want = ref(input_ids=ids, attention_mask=mask, labels=ids)
    want.loss.backward()
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        hf = cls(_encoder_config(kind))
    model = smp.DistributedModel(hf)
    encoder = getattr(model.get_module(), kind).encoder
    assert isinstance(encoder, DistributedTransformer) and len(encoder.seq_layers) == 2

    @smp.step
    def step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> Any:
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        model.backward(out.loss)
        return out.loss, out.logits

    loss, logits = step(model, ids, mask)
    torch.testing.assert_close(loss.reduce_mean(), want.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.concat(), want.logits.detach(), rtol=1e-5, atol=1e-5)
    grads = translate_state_dict_to_hf(full_state_dict(model.get_module(), smp.get_tp_process_group(), grads=True))
    # the marked pooler / head nn.Linear layers became DistributedLinear, which holds its weights at .linear.
    grads = {k.replace(".linear.", "."): v for k, v in grads.items()}
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return {"kind": kind}


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_marked_encoder_at_tp2_matches_the_hf_model(kind: str) -> None:
    assert run_ranks(_masked_lm, 2, args=(kind,), timeout=110) == [{"kind": kind}] * 2


def _delayed() -> float:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "delayed_parameter_initialization": True,
              "random_seed": 3, "prescaled_batch": True, "comm_timeout": 60.0})
    with smp.model_creation(tensor_parallelism=True):
        model = transformers.AutoModelForCausalLM.from_config(_config())
    assert all(p.is_meta for p in model.parameters())
    model = smp.DistributedModel(model)
    assert not any(p.is_meta for p in model.parameters())

    @smp.step
    def loss_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    with torch.no_grad():
        return float(loss_step(model, _data()).reduce_mean().item())


def test_delayed_gpt2_gets_the_documented_fresh_weights() -> None:
    """Delayed (meta) parameters: the SMP v1 structure is initialised afresh from ``random_seed``, the
    same full model on every TP rank: its loss is that of the one-process module built after
    ``torch.manual_seed(random_seed)``."""
    from smp.torch.nn.huggingface.gpt2 import GPT2DistributedTransformerLMHead

    torch.manual_seed(3)
    with torch.no_grad():
        want = GPT2DistributedTransformerLMHead(_config())(input_ids=_data(), labels=_data()).loss.item()
    assert run_ranks(_delayed, 2, timeout=110) == pytest.approx([want, want], rel=1e-5)
