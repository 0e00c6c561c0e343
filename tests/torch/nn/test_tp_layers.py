"""smp.torch.nn building blocks on 2 real gloo ranks against the dense single-process layers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.spawn import run_ranks


def _init(extra: dict[str, Any] | None = None) -> tuple[Any, int]:
    import smp.torch as smp

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0, **(extra or {})})
    return smp, smp.tp_rank()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _linears() -> str:
    from smp.torch.nn import ColumnParallelLinear, RowParallelLinear, is_tp_sharded, tp_split_dim

    _, r = _init()
    torch.manual_seed(0)
    d1, d2 = nn.Linear(6, 8), nn.Linear(8, 5)
    torch.manual_seed(0)
    # Built from the same seed, the parallel layers hold exactly the dense layers' slices.
    c, rw = ColumnParallelLinear(6, 8), RowParallelLinear(8, 5)
    _close(c.weight, d1.weight[4 * r:4 * r + 4])
    _close(c.bias, d1.bias[4 * r:4 * r + 4])
    _close(rw.weight, d2.weight[:, 4 * r:4 * r + 4])
    _close(rw.bias, d2.bias)
    assert is_tp_sharded(c.weight) and tp_split_dim(c.weight) == 0 and tp_split_dim(rw.weight) == 1
    assert not is_tp_sharded(rw.bias)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 6, generator=g)
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    dense = d2(torch.relu(d1(xd)))
    par = rw(torch.relu(c(xp)))
    _close(par, dense)
    w = torch.randn(dense.shape, generator=g)
    (dense * w).sum().backward()
    (par * w).sum().backward()
    _close(xp.grad, xd.grad)
    _close(c.weight.grad, d1.weight.grad[4 * r:4 * r + 4])
    _close(c.bias.grad, d1.bias.grad[4 * r:4 * r + 4])
    _close(rw.weight.grad, d2.weight.grad[:, 4 * r:4 * r + 4])
    _close(rw.bias.grad, d2.bias.grad)
    # gather_output / input_is_parallel=False paths, from existing dense layers.
    cg = ColumnParallelLinear.from_linear(d1, gather_output=True)
    rf = RowParallelLinear.from_linear(d2, input_is_parallel=False)
    xq = x.clone().requires_grad_()
    out = rf(cg(xq))
    _close(out, d2(d1(x)))
    out.sum().backward()
    xr = x.clone().requires_grad_()
    d2(d1(xr)).sum().backward()
    _close(xq.grad, xr.grad)
    return "ok"


def test_column_row_parallel_linear_match_dense() -> None:
    assert run_ranks(_linears, 2) == ["ok", "ok"]


def _embedding_and_loss() -> str:
    from smp.torch.nn import ColumnParallelLinear, VocabParallelEmbedding, parallel_cross_entropy
    from smp.torch.nn.mappings import gather_from_tp

    smp, r = _init()
    torch.manual_seed(0)
    emb, head = nn.Embedding(10, 4, padding_idx=7), nn.Linear(4, 10, bias=False)
    pemb = VocabParallelEmbedding.from_embedding(emb)
    phead = ColumnParallelLinear.from_linear(head)
    assert (pemb.vocab_start, pemb.vocab_end) == (5 * r, 5 * r + 5)
    ids = torch.tensor([[0, 9, 7, 4, 5], [3, 3, 8, 1, 7]])
    target = torch.tensor([[9, 7, 4, 5, -100], [3, 8, 1, 7, 0]])
    dense_logits = head(emb(ids))
    dense_loss = F.cross_entropy(dense_logits.flatten(0, 1), target.flatten())
    shard_logits = phead(pemb(ids))
    assert shard_logits.shape[-1] == 5
    _close(gather_from_tp(shard_logits.detach(), smp.get_tp_process_group()), dense_logits.detach())
    loss = parallel_cross_entropy(shard_logits, target)
    _close(loss, dense_loss)
    dense_loss.backward()
    loss.backward()
    _close(pemb.weight.grad, emb.weight.grad[5 * r:5 * r + 5])
    _close(phead.weight.grad, head.weight.grad[5 * r:5 * r + 5])
    # Other reductions, and logits whose gradient is taken directly.
    z = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0, 9, -100, 5, 4, 2])
    for reduction in ("sum", "none"):
        zd = z.clone().requires_grad_()
        zp = z[:, 5 * r:5 * r + 5].clone().requires_grad_()
        ref = F.cross_entropy(zd, t, reduction=reduction)
        got = parallel_cross_entropy(zp, t, reduction=reduction)
        _close(got, ref)
        wt = torch.arange(1.0, 7.0) if reduction == "none" else torch.tensor(2.0)
        (ref * wt).sum().backward()
        (got * wt).sum().backward()
        _close(zp.grad, zd.grad[:, 5 * r:5 * r + 5])
    return "ok"


def test_vocab_parallel_embedding_and_parallel_cross_entropy_match_dense() -> None:
    assert run_ranks(_embedding_and_loss, 2) == ["ok", "ok"]


def _sizes_error() -> str:
    from smp.torch.nn import ColumnParallelLinear, RowParallelLinear, TPShardingError, VocabParallelEmbedding

    _init()
    messages = []
    for make in (lambda: ColumnParallelLinear(4, 7), lambda: RowParallelLinear(5, 4),
                 lambda: VocabParallelEmbedding(11, 4)):
        with pytest.raises(TPShardingError) as info:
            make()
        assert isinstance(info.value, ValueError)
        messages.append(str(info.value))
    assert "out_features=7" in messages[0] and "tensor_parallel_degree=2" in messages[0] and "Fix:" in messages[0]
    assert "in_features=5" in messages[1]
    assert "vocab_size" in messages[2] and "11" in messages[2]
    return "ok"


def test_non_divisible_sizes_raise_a_clear_error() -> None:
    assert run_ranks(_sizes_error, 2) == ["ok", "ok"]


def _rng(seed_key: str) -> tuple[list[float], list[float], list[float]]:
    from smp.torch.nn import get_rng_state_tracker, seed_tensor_parallel
    from smp.torch.nn.rng import tp_rng

    _, r = _init({seed_key: 5})
    torch.manual_seed(123)
    replicated = nn.Linear(3, 2).weight.detach().flatten().tolist()
    used = seed_tensor_parallel()
    assert used == 5 + 2718 + r
    with tp_rng():
        a = torch.rand(4).tolist()
    with get_rng_state_tracker().fork():
        b = torch.rand(4).tolist()
    after_default = torch.rand(2).tolist()
    seed_tensor_parallel()
    with tp_rng():
        again = torch.rand(4).tolist()
    assert again == a, "the TP stream is reproducible from the seed"
    assert a != b, "the TP stream advances across forks"
    return replicated, a, after_default


@pytest.mark.parametrize("seed_key", ["tensor_parallel_seed", "random_seed"])
def test_rng_tracker_differs_per_tp_rank_and_keeps_replicas_identical(seed_key: str) -> None:
    (rep0, tp0, def0), (rep1, tp1, def1) = run_ranks(_rng, 2, args=(seed_key,))
    assert rep0 == rep1
    assert tp0 != tp1
    assert def0 == def1, "forking must not disturb the default generator"


def _scaled_batch() -> str:
    from smp.torch.nn import BatchScaled, DistributedTransformerOutputLayer, full_state_dict

    torch.manual_seed(0)
    dense = DistributedTransformerOutputLayer(8, 16, 0.0)  # before init: tp 1, the dense layer
    smp, r = _init()
    torch.manual_seed(0)
    layer = BatchScaled(DistributedTransformerOutputLayer(8, 16, 0.0))
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(3, 4, 8, generator=g) for _ in range(2)]  # each rank's own batch
    ws = [torch.randn(3, 4, 8, generator=g) for _ in range(2)]
    x = xs[r].clone().requires_grad_()
    y = layer(x)
    _close(y, dense(xs[r]))
    (y * ws[r]).sum().backward()
    # The region's parameters see both ranks' samples: the gradient of the mean of both losses;
    # the input gradient is that of the rank's own loss.
    dense_inputs = [xi.clone().requires_grad_() for xi in xs]
    (sum((dense(xi) * wi).sum() for xi, wi in zip(dense_inputs, ws)) / 2).backward()
    _close(x.grad, 2 * dense_inputs[r].grad)
    grads = full_state_dict(layer.module, smp.get_tp_process_group(), grads=True)
    for name, p in dense.named_parameters():
        _close(grads[name], p.grad)
    return "ok"


def test_batch_scaling_gives_each_rank_its_own_outputs() -> None:
    assert run_ranks(_scaled_batch, 2) == ["ok", "ok"]


class _Tracing:
    _tracing = True


def _trace_alone() -> str:
    from smp.torch.nn import ColumnParallelLinear, RowParallelLinear, parallel_cross_entropy

    import smp.state as smp_state

    smp, r = _init()
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(4, 8, gather_output=True), RowParallelLinear(8, 4)
    if r == 0:  # rank 0 runs the model alone, as when it traces for automatic partitioning
        with smp_state.override(model=_Tracing()):
            out = col(torch.ones(2, 4))
            assert out.shape == (2, 8)
            assert row(out[:, :4]).shape == (2, 4)
            assert parallel_cross_entropy(torch.randn(3, 5), torch.tensor([0, 1, 2])).isfinite()
    smp.barrier()
    return "ok"


def test_collectives_are_skipped_while_one_rank_traces_alone() -> None:
    assert run_ranks(_trace_alone, 2, timeout=60) == ["ok", "ok"]
