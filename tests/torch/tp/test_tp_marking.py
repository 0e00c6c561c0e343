"""SMP v1 TP marking (`tensor_parallelism`, `set_tensor_parallelism`, `tp_register*`) and its replacement."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import smp.torch as smp
import torch
from smp.torch.nn import DistributedLinear, DistributedTransformerOutputLayer
from smp.torch.tp import DistributedModelWrappedError, apply_tensor_parallelism, is_marked
from smp.torch.tp.registry import REGISTRY
from torch import nn

import smp.state as smp_state
from tests.helpers.spawn import run_ranks


class Block(nn.Module):
    """A user MLP registered below for `DistributedTransformerOutputLayer`."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inner), nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * scale + x


def _block_hooks() -> None:
    smp.tp_register_with_module(
        Block, DistributedTransformerOutputLayer,
        init_hook=lambda hidden, inner: ((), {"hidden_size": hidden, "intermediate_size": inner,
                                              "hidden_dropout_prob": 0.0, "activation": "relu"}),
        forward_hook=lambda x, scale=1.0: ((x,), {}),
        return_hook=lambda out: ("wrapped", out))


def test_marking_contexts_nest_and_set_tensor_parallelism_marks_topmost() -> None:
    with smp.tensor_parallelism():
        a = nn.Linear(4, 4)
        with smp.tensor_parallelism(enabled=False):
            b = nn.Linear(4, 4)
        c = nn.Embedding(4, 4)
    d = nn.Linear(4, 4)
    assert [is_marked(m) for m in (a, b, c, d)] == [True, False, True, False]
    assert "__init__" in nn.Linear.__dict__ and nn.Linear.__init__.__qualname__ == "Linear.__init__"
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 2)))
    smp.set_tensor_parallelism(model)
    assert is_marked(model[0]) and is_marked(model[1][1]) and not is_marked(model[1][0])
    smp.set_tensor_parallelism(model, enabled=False)
    assert not any(is_marked(m) for m in model.modules())
    with smp_state.override(model=object()):
        with pytest.raises(DistributedModelWrappedError, match="before smp.DistributedModel"):
            smp.set_tensor_parallelism(model)


def test_shared_weights_stay_undistributed() -> None:
    with smp.tensor_parallelism():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[1].weight = model[0].weight
    out = apply_tensor_parallelism(model)
    assert [type(m) for m in out] == [nn.Linear, nn.Linear]


def _marked(kind: str) -> str:
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    group = smp.get_tp_process_group()
    from smp.torch.nn import full_state_dict

    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    if kind == "builtin":
        torch.manual_seed(0)
        with smp.tensor_parallelism(fused_softmax=True, fused_bias_gelu=False):  # SMP v1 knobs: accepted
            model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4), nn.Linear(4, 3))
            with smp.tensor_parallelism(enabled=False):
                model.append(nn.Linear(3, 2))
        dense = copy.deepcopy(model)
        model = apply_tensor_parallelism(model)
        # 6 and 4 split over 2; the last marked Linear(4, 3)... splits its 4 inputs too; the unmarked one stays.
        assert [type(m).__name__ for m in model] == ["DistributedLinear", "ReLU", "DistributedLinear",
                                                     "DistributedLinear", "Linear"]
        out, ref = model(x), dense(x)
        torch.testing.assert_close(out, ref)
        (out ** 2).sum().backward()
        (ref ** 2).sum().backward()
        grads = full_state_dict(model, group, grads=True)
        for name, p in dense.named_parameters():
            torch.testing.assert_close(grads[name.replace(".weight", ".linear.weight").replace(".bias", ".linear.bias")
                                             if name.split(".")[0] in "023" else name], p.grad)
        with smp.tensor_parallelism():
            odd = nn.Sequential(nn.Linear(5, 2))
        assert isinstance(apply_tensor_parallelism(odd)[0], nn.Linear), "5 inputs do not split: kept"
        return "ok"
    if kind == "registered":
        _block_hooks()
        try:
            with smp.tensor_parallelism(intermediate_size=16):  # kwargs override the init-hook arguments
                torch.manual_seed(0)
                model = nn.Sequential(Block(8, 12))
            model = apply_tensor_parallelism(model)
        finally:
            del REGISTRY[Block]
        tag, out = model[0](x, scale=3.0)
        assert tag == "wrapped"
        assert model[0].dense1.weight.shape == (8, 8), "intermediate 16 split over 2 ranks"
        assert "0.dense1.weight" in dict(model.named_parameters()), "the hooks add no level (SMP v1's names)"
        w = full_state_dict(model[0], group)
        h = torch.relu(x @ w["dense1.weight"].T + w["dense1.bias"]) @ w["dense2.weight"].T + w["dense2.bias"] + x
        ref = torch.nn.functional.layer_norm(h, (8,), w["layernorm.weight"], w["layernorm.bias"])
        torch.testing.assert_close(out, ref)
        return "ok"
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    with smp.tensor_parallelism():
        model = transformers.LlamaForCausalLM(cfg)
    dense = copy.deepcopy(model)
    model = apply_tensor_parallelism(model)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "RowParallelLinear"
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, dense(input_ids=ids, labels=ids).loss)
    return "ok"


@pytest.mark.parametrize("kind", ["builtin", "registered", "hf"])
def test_marked_modules_are_replaced_and_compute_the_same(kind: str) -> None:
    assert run_ranks(_marked, 2, args=(kind,), timeout=120) == ["ok", "ok"]


def test_tp_register_decorator_registers_the_class() -> None:
    @smp.tp_register(DistributedLinear, init_hook=lambda n: ((n, n), {}))
    class Square(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()

    try:
        with smp.tensor_parallelism():
            holder = nn.Sequential(Square(4))
        out: Any = apply_tensor_parallelism(holder)
        assert isinstance(out[0], DistributedLinear) and out[0].in_features == 4
        smp.set_tensor_parallelism(nn.Sequential(Square(2)))  # marking works; building needs the init args
        late = nn.Sequential(Square(2))
        smp.set_tensor_parallelism(late)
        with pytest.raises(smp.exceptions.SMPError, match="not created inside"):
            apply_tensor_parallelism(late)
    finally:
        del REGISTRY[Square]
