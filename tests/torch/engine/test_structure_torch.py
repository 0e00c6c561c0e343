"""The core walker on torch values: wire messages and real Hugging Face outputs keep their containers."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from smp.torch.engine.wire import Slot, pack, unpack, walk

from smp.structure import map_structure

Pair = namedtuple("Pair", "a b")


def test_pack_replaces_tensors_by_slots_and_unpack_puts_them_back() -> None:
    x, y = torch.ones(2, requires_grad=True), torch.zeros(3)
    obj = {"p": Pair(x, [y, 1]), "o": OrderedDict(k=(x,)), "s": torch.Size([2, 3])}
    skeleton, tensors = pack(obj)
    assert [id(t) for t in tensors] == [id(x), id(y), id(x)]
    assert skeleton["p"] == Pair(Slot(0, True), [Slot(1, False), 1]) and type(skeleton["o"]) is OrderedDict
    assert skeleton["s"] == torch.Size([2, 3]) and type(skeleton["s"]) is torch.Size
    back = unpack(skeleton, tensors)
    assert back["p"].a is x and back["p"].b[0] is y and back["o"]["k"][0] is x


def test_walk_lists_the_leaves_of_a_call_with_size_arguments() -> None:
    """A module called with a ``torch.Size`` (HF GPT-2's ``view(output_shape)``) is walked, not rebuilt."""
    x = torch.ones(2)
    assert walk(((x, torch.Size([2, 3])), {"shape": torch.Size([4])})) == [x, 2, 3, 4]


def test_a_hugging_face_model_output_survives_the_wire_and_the_detach_walk() -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")
    logits = torch.randn(2, 3, requires_grad=True)
    out = outputs.CausalLMOutputWithPast(loss=logits.sum(), logits=logits)
    skeleton, tensors = pack(out)
    assert type(skeleton) is type(out) and list(skeleton.keys()) == ["loss", "logits"]
    back = unpack(skeleton, tensors)
    assert type(back) is type(out) and back.logits is logits and back["loss"] is tensors[0]
    assert back.past_key_values is None and back.to_tuple()[1] is logits
    detached = map_structure(out, lambda t: t.detach() if isinstance(t, torch.Tensor) else t)
    assert type(detached) is type(out) and not detached.logits.requires_grad and out.logits.requires_grad
    assert list(detached.keys()) == ["loss", "logits"]
