"""A TP model saved in Hugging Face format loads in plain transformers; an HF checkpoint loads shard by shard."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import run_ranks
from tests.torch.test_tp_hf import _batch, _model

transformers = pytest.importorskip("transformers")


def _train_and_save(kind: str, path: str) -> torch.Tensor:
    import smp.torch as smp
    from smp.torch.nn import gather_from_tp
    from smp.torch.tp import save_pretrained

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.transform(_model(kind))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, labels = _batch()
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    save_pretrained(model, path)
    with torch.no_grad():
        return gather_from_tp(model(input_ids=ids).logits, smp.get_tp_process_group())


def _load_shards(kind: str, path: str) -> torch.Tensor:
    import smp.torch as smp
    from smp.torch.nn import gather_from_tp
    from smp.torch.tp import load_hf_checkpoint

    smp.init({"tensor_parallel_degree": 2, "ddp": True, "comm_timeout": 60.0})
    model = smp.transform(_model(kind, seed=100 + smp.rank()))  # different weights until loaded
    assert load_hf_checkpoint(model, path) == []
    with torch.no_grad():
        return gather_from_tp(model(input_ids=_batch()[0]).logits, smp.get_tp_process_group())


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_save_pretrained_round_trip(kind: str, tmp_path: object) -> None:
    path = str(tmp_path)
    trained = run_ranks(_train_and_save, 2, args=(kind, path), timeout=180)
    torch.testing.assert_close(trained[0], trained[1])
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    with torch.no_grad():
        logits = plain(input_ids=_batch()[0]).logits
    torch.testing.assert_close(logits, trained[0], rtol=1e-5, atol=1e-5)
    untrained = _model(kind)(input_ids=_batch()[0]).logits.detach()
    assert not torch.allclose(untrained, logits, atol=1e-3), "the checkpoint holds the trained weights"
    loaded = run_ranks(_load_shards, 2, args=(kind, path), timeout=180)
    torch.testing.assert_close(loaded[0], logits, rtol=1e-5, atol=1e-5)
