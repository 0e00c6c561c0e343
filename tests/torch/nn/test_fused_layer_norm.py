"""smp.torch.nn.FusedLayerNorm: apex's constructor and semantics, on torch's layer norm without apex."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from smp.torch.nn import FusedLayerNorm
from smp.torch.nn.fused import APEX_FUSED_LAYER_NORM


@pytest.mark.parametrize("shape", [8, (8,), [3, 8], torch.Size([3, 8])])
def test_forward_and_backward_are_layer_norm(shape: object) -> None:
    torch.manual_seed(0)
    ln = FusedLayerNorm(shape, eps=1e-6)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)  # type: ignore[arg-type]
    assert tuple(ln.normalized_shape) == dims and ln.eps == 1e-6 and ln.elementwise_affine
    with torch.no_grad():  # not the initial ones/zeros, so a swapped weight and bias would show
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(4, 3, 8, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_(True)
    w, b = ln.weight.detach().clone().requires_grad_(True), ln.bias.detach().clone().requires_grad_(True)
    out, ref = ln(x), F.layer_norm(ref_x, dims, w, b, 1e-6)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for ours, theirs in ((x.grad, ref_x.grad), (ln.weight.grad, w.grad), (ln.bias.grad, b.grad)):
        torch.testing.assert_close(ours, theirs)


def test_apex_defaults_parameters_and_state_dict() -> None:
    ln = FusedLayerNorm(5)
    assert ln.eps == 1e-5
    assert torch.equal(ln.weight, torch.ones(5)) and torch.equal(ln.bias, torch.zeros(5))
    assert set(ln.state_dict()) == {"weight", "bias"}  # the keys apex's layer saves
    plain = FusedLayerNorm(5, elementwise_affine=False)
    assert plain.weight is None and plain.bias is None and not list(plain.parameters())
    x = torch.randn(2, 5)
    torch.testing.assert_close(plain(x), F.layer_norm(x, (5,)))
    restored = pickle.loads(pickle.dumps(ln))  # a model holding it pickles (torch.save(model))
    assert type(restored) is type(ln) and torch.equal(restored.weight, ln.weight)
    assert type(ln).__name__ == "FusedLayerNorm"


@pytest.mark.skipif(APEX_FUSED_LAYER_NORM, reason="apex is installed: FusedLayerNorm is apex's layer")
def test_without_apex_it_is_a_torch_layer_norm() -> None:
    ln = FusedLayerNorm(4, memory_efficient=True)  # newer apex's argument is accepted
    assert isinstance(ln, torch.nn.LayerNorm) and ln.memory_efficient
    assert "FusedLayerNorm((4,), eps=1e-05" in repr(ln)


@pytest.mark.skipif(APEX_FUSED_LAYER_NORM, reason="apex's layer validates its own arguments")
def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(TypeError, match="normalized_shape='8'"):
        FusedLayerNorm("8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"normalized_shape=\(8, 0\)"):
        FusedLayerNorm((8, 0))
    with pytest.raises(ValueError, match="eps=0"):
        FusedLayerNorm(8, eps=0)
