"""examples/gpt_model.py: the nn.Sequential and the ModuleList GPT are the same model."""

from __future__ import annotations

import torch

from examples.gpt_model import GPT, gpt, sequential_to_modulelist_keys

SMALL = {"vocab": 64, "width": 32, "layers": 3, "heads": 4, "seq": 16}


def _renamed(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    prefixes = sequential_to_modulelist_keys(layers)
    out = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        out[prefixes[head + "."] + rest] = value
    return out


def test_same_seed_gives_the_same_parameters_key_for_key() -> None:
    torch.manual_seed(0)
    seq = gpt(**SMALL)
    torch.manual_seed(0)
    loop = GPT(**SMALL)
    renamed = _renamed(seq.state_dict(), SMALL["layers"])
    theirs = loop.state_dict()
    assert list(renamed) == list(theirs)
    for key, value in renamed.items():
        assert torch.equal(value, theirs[key]), key


def test_same_weights_give_the_same_logits_and_gradients() -> None:
    torch.manual_seed(1)
    seq = gpt(**SMALL)
    loop = GPT(**SMALL)
    loop.load_state_dict(_renamed(seq.state_dict(), SMALL["layers"]))
    ids = torch.randint(0, SMALL["vocab"], (2, SMALL["seq"]), generator=torch.Generator().manual_seed(2))
    a, b = seq(ids), loop(ids)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    grads = dict(loop.named_parameters())
    for key, p in _renamed(dict(seq.named_parameters()), SMALL["layers"]).items():
        assert torch.equal(p.grad, grads[key].grad), key
