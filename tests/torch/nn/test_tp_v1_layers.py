"""SMP v1 ``smp.nn.Distributed*`` layers: the reference math at tp=1, and tp=2 ranks against tp=1."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from smp.torch.nn import (
    DistributedAttentionLayer,
    DistributedEmbedding,
    DistributedLinear,
    DistributedTransformer,
    DistributedTransformerLayer,
    DistributedTransformerOutputLayer,
    TPShardingError,
)
from torch import nn

from tests.helpers.spawn import run_ranks

N, S, H, HEADS, D, INTER = 2, 5, 8, 4, 3, 16


def _mask() -> torch.Tensor:
    keep = torch.ones(N, S)
    keep[1, -2:] = 0  # the second sample has two padded keys
    return ((1.0 - keep) * -10000.0).view(N, 1, 1, S)


def _ref_attention(layer: DistributedAttentionLayer, x: torch.Tensor, mask: torch.Tensor | None,
                   causal: bool, cross: torch.Tensor | None = None) -> torch.Tensor:
    """Reference 3.8 math written out on the (tp=1) layer's full weights."""
    h = layer.pre_layernorm(x) if layer.pre_layernorm is not None else x
    c = cross if cross is not None else h

    def lin(m: Any, t: torch.Tensor) -> torch.Tensor:
        return t @ m.weight.T + m.bias

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], HEADS, D).permute(0, 2, 1, 3)

    q, k, v = heads(lin(layer.query, h)), heads(lin(layer.key, c)), heads(lin(layer.value, c))
    scores = torch.einsum("nhsd,nhtd->nhst", q, k) / math.sqrt(D)
    if causal:
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), -10000.0)
    if mask is not None:
        scores = scores + mask
    ctx = torch.einsum("nhst,nhtd->nhsd", scores.softmax(-1), v).permute(0, 2, 1, 3).reshape(x.shape[0], S, -1)
    out = lin(layer.dense, ctx) + x
    return layer.layernorm(out) if layer.layernorm is not None else out


@pytest.mark.parametrize("pre,post,causal", [(False, True, False), (True, False, True), (True, True, True)])
def test_attention_layer_follows_the_reference_math(pre: bool, post: bool, causal: bool) -> None:
    torch.manual_seed(0)
    layer = DistributedAttentionLayer(HEADS, D, H, 0.0, 0.0, causal_mask_size=S if causal else None,
                                      pre_layernorm=pre, post_layernorm=post, use_normal_initialization=True)
    x, mask = torch.randn(N, S, H), _mask()
    torch.testing.assert_close(layer((x, mask)), _ref_attention(layer, x, mask, causal))
    cross = DistributedAttentionLayer(HEADS, D, H, 0.0, 0.0, cross_attention=True, pre_layernorm=pre,
                                      post_layernorm=post)
    states = torch.randn(N, S, H)
    torch.testing.assert_close(cross((x, states, mask)), _ref_attention(cross, x, mask, False, states))


def test_output_layer_and_transformer_layer_follow_the_reference_math() -> None:
    torch.manual_seed(0)
    mlp = DistributedTransformerOutputLayer(H, INTER, 0.0, activation="relu", pre_layernorm=True,
                                            post_layernorm=True)
    x = torch.randn(N, S, H)
    h = mlp.pre_layernorm(x)  # type: ignore[misc]
    ref = mlp.layernorm(F.relu(h @ mlp.dense1.weight.T + mlp.dense1.bias) @ mlp.dense2.weight.T  # type: ignore[misc]
                        + mlp.dense2.bias + x)
    torch.testing.assert_close(mlp(x), ref)
    layer = DistributedTransformerLayer(HEADS, D, H, INTER, 0.0, 0.0, causal_mask_size=S)
    out, mask = layer((x, _mask()))
    torch.testing.assert_close(out, layer.output(_ref_attention(layer.attention, x, _mask(), True)))
    assert torch.equal(mask, _mask())


def test_v1_layer_argument_errors() -> None:
    with pytest.raises(ValueError, match="at least one of them must be True"):
        DistributedAttentionLayer(HEADS, D, H, pre_layernorm=False, post_layernorm=False)
    with pytest.raises(ValueError, match="activation='tanh'"):
        DistributedTransformerOutputLayer(H, INTER, activation="tanh")


def _builders() -> dict[str, Callable[[], nn.Module]]:
    common = {"num_attention_heads": HEADS, "attention_head_size": D, "hidden_size": H,
              "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0}
    return {
        "linear": lambda: DistributedLinear(H, 6),
        "embedding": lambda: DistributedEmbedding(11, H, padding_idx=0),
        "attention": lambda: DistributedAttentionLayer(causal_mask_size=S, pre_layernorm=True, **common),
        "cross": lambda: DistributedAttentionLayer(cross_attention=True, **common),
        "output": lambda: DistributedTransformerOutputLayer(H, INTER, 0.0),
        "layer": lambda: DistributedTransformerLayer(intermediate_size=INTER, add_cross_attention=True, **common),
        "stack": lambda: DistributedTransformer(num_layers=2, intermediate_size=INTER, pre_layernorm=True,
                                                post_layernorm=True, causal_mask_size=S, **common),
    }


def _call(kind: str, m: nn.Module, x: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    if kind == "embedding":
        return m(torch.tensor([[0, 3, 10, 7, 1], [2, 2, 9, 0, 5]])) * x.sum(-1, keepdim=True)  # type: ignore[no-any-return]
    if kind in ("linear", "output"):
        return m(x)  # type: ignore[no-any-return]
    if kind == "cross":
        return m((x, states, _mask()))  # type: ignore[no-any-return]
    if kind == "layer":
        return m((x, states, _mask(), None))[0]  # type: ignore[no-any-return]
    if kind == "stack":
        return m((x, _mask()))[0]  # type: ignore[no-any-return]
    return m((x, _mask()))  # type: ignore[no-any-return]


def _tp2_against_tp1() -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    g = torch.Generator().manual_seed(5)
    x, states = torch.randn(N, S, H, generator=g), torch.randn(N, S, H, generator=g)
    dense: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}
    for kind, make in _builders().items():  # before smp.init: tp size 1, the dense computation
        torch.manual_seed(0)
        m = make()
        xd = x.clone().requires_grad_()
        out = _call(kind, m, xd, states)
        (out * out).sum().backward()
        dense[kind] = (out.detach(), xd.grad, {n: p.grad for n, p in m.named_parameters()})  # type: ignore[misc]
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    group = smp.get_tp_process_group()
    for kind, make in _builders().items():
        torch.manual_seed(0)
        m = make()
        xp = x.clone().requires_grad_()
        out = _call(kind, m, xp, states)
        (out * out).sum().backward()
        ref_out, ref_xgrad, ref_grads = dense[kind]
        torch.testing.assert_close(out, ref_out, msg=lambda s, k=kind: f"{k} output: {s}")
        torch.testing.assert_close(xp.grad, ref_xgrad, msg=lambda s, k=kind: f"{k} input grad: {s}")
        grads = full_state_dict(m, group, grads=True)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], msg=lambda s, n=f"{kind}.{name}": f"{n}: {s}")
    with pytest.raises(TPShardingError, match="num_attention_heads=3"):
        DistributedAttentionLayer(3, D, H)
    with pytest.raises(TPShardingError, match="intermediate_size=9"):
        DistributedTransformerOutputLayer(H, 9)
    return "ok"


def test_v1_layers_at_tp2_match_the_dense_layers() -> None:
    assert run_ranks(_tp2_against_tp1, 2) == ["ok", "ok"]


def _lm(num_token_types: int = 0) -> Any:
    from smp.torch.nn import DistributedTransformerLMHead

    torch.manual_seed(0)
    return DistributedTransformerLMHead(num_layers=2, num_attention_heads=HEADS, attention_head_size=D,
                                        hidden_size=H, intermediate_size=INTER, vocab_size=12, num_positions=S,
                                        attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                                        num_token_types=num_token_types, causal_mask_size=S, pre_layernorm=True,
                                        post_layernorm=False)


def _lm_inputs() -> tuple[Any, ...]:
    ids = torch.tensor([[1, 5, 11, 0, 7], [3, 3, 9, 2, 6]])
    pad = torch.zeros(N, S, dtype=torch.long)
    pad[1, -1] = 1
    labels = ids.clone()
    labels[1, -1] = -100
    return ids, pad, torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]), None, labels


def test_lm_head_follows_the_reference_math() -> None:
    lm = _lm(num_token_types=2)
    ids, pad, types, _, labels = _lm_inputs()
    loss, logits = lm((ids, pad, types, None, labels))
    x = lm.word_embedding.weight[ids] + lm.position_embedding.weight[torch.arange(S)] + lm.token_type_embedding.weight[types]
    hidden = lm.transformer((x, (pad.float() * -10000.0).view(N, 1, 1, S)))[0]
    ref_logits = hidden @ lm.word_embedding.weight.T
    torch.testing.assert_close(logits, ref_logits)
    ref_loss = F.cross_entropy(ref_logits[:, :-1].reshape(-1, 12), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref_loss)
    (only,) = lm((ids, pad, types, None, None))
    torch.testing.assert_close(only, logits)


def _lm_tp2() -> str:
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    dense = _lm()
    ref_loss, ref_logits = dense(_lm_inputs())
    ref_loss.backward()
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    group = smp.get_tp_process_group()
    lm = _lm()
    loss, logits = lm(_lm_inputs())
    assert logits.shape[-1] == 12, "the full logits (the loss used this rank's vocabulary slice)"
    torch.testing.assert_close(logits.detach(), ref_logits.detach())
    torch.testing.assert_close(loss, ref_loss)
    loss.backward()
    grads = full_state_dict(lm, group, grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda s, n=name: f"{n}: {s}")
    return "ok"


def test_lm_head_at_tp2_matches_tp1() -> None:
    assert run_ranks(_lm_tp2, 2) == ["ok", "ok"]


def _dropout() -> tuple[list[float], list[float]]:
    import smp.torch as smp
    from smp.torch.nn import seed_tensor_parallel

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0, "tensor_parallel_seed": 4})
    torch.manual_seed(0)
    layer = DistributedTransformerLayer(HEADS, D, H, INTER, attention_dropout_prob=0.5, hidden_dropout_prob=0.2)
    x = torch.randn(N, S, H, generator=torch.Generator().manual_seed(1))
    seed_tensor_parallel()
    torch.manual_seed(3)  # the default generator (replicated dropout) is seeded alike on both ranks
    first = layer((x, None))[0]
    seed_tensor_parallel()
    torch.manual_seed(3)
    again = layer((x, None))[0]
    torch.testing.assert_close(first, again)
    layer.eval()
    plain = layer((x, None))[0]
    assert not torch.allclose(first, plain)
    return first.flatten().tolist(), plain.flatten().tolist()


def test_dropout_in_tp_regions_keeps_replicas_identical_and_is_reproducible() -> None:
    (out0, plain0), (out1, plain1) = run_ranks(_dropout, 2)
    assert out0 == out1, "after the row-parallel allreduce and replicated dropout both ranks agree"
    assert plain0 == plain1


def _lm_per_rank_batches() -> str:
    """SMP v1's default prescaled_batch: False: each TP rank passes its own sample; the step computes
    the loss from the logits the model hands back (the rank's own rows, full vocabulary)."""
    import smp.torch as smp
    from smp.torch.nn import full_state_dict

    ids, pad, _, _, _ = _lm_inputs()
    dense = _lm()
    per_row = []
    for r in range(2):
        (logits,) = dense((ids[r:r + 1], pad[r:r + 1], None, None, None))
        per_row.append(F.cross_entropy(logits[0, :-1], ids[r, 1:]))
    (sum(per_row) / 2).backward()
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.DistributedModel(_lm())
    r = smp.tp_rank()

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        (logits,) = model((ids, pad, None, None, None))
        assert logits.shape == (1, S, 12)
        loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
        model.backward(loss)
        return loss

    loss = train_step(model, ids[r:r + 1], pad[r:r + 1]).reduce_mean()
    torch.testing.assert_close(loss, per_row[r].detach())
    grads = full_state_dict(model.module, smp.get_tp_process_group(), grads=True)
    for name, p in dense.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=lambda s, n=name: f"{n}: {s}")
    return "ok"


def test_lm_head_with_per_rank_batches_gives_each_rank_its_full_logits() -> None:
    assert run_ranks(_lm_per_rank_batches, 2) == ["ok", "ok"]
