"""Unmodified Hugging Face models (built from config, no download) train pipelined like in one process:
every family smp claims, called the Hugging Face way (``labels=`` in, the model's own loss out)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.spawn import run_ranks

transformers = pytest.importorskip("transformers")


def _config(kind: str) -> Any:
    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "max_position_embeddings": 32, "use_cache": False}
    gpt = {"vocab_size": 64, "n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 32, "use_cache": False,
           "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}
    bert = {**common, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if kind == "llama":
        return transformers.LlamaConfig(num_key_value_heads=2, **common)
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(**common)
    if kind == "mistral":
        return transformers.MistralConfig(num_key_value_heads=2, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(num_key_value_heads=2, **common)
    if kind == "gpt2":
        return transformers.GPT2Config(**gpt)
    if kind == "gptj":
        return transformers.GPTJConfig(rotary_dim=4, **gpt)
    if kind == "falcon":  # parallel attention and MLP, summed in place: mlp_output += attention_output
        return transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                         hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    if kind == "bert":
        return transformers.BertConfig(**bert)
    if kind == "roberta":  # positions start after the padding index
        return transformers.RobertaConfig(**{**bert, "max_position_embeddings": 40})
    return transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common)


MASKED = ("bert", "roberta")


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    auto = transformers.AutoModelForMaskedLM if kind in MASKED else transformers.AutoModelForCausalLM
    return auto.from_config(_config(kind), attn_implementation="eager")


def _layers(model: Any) -> Any:
    """The model's decoder / encoder layers: its longest ModuleList (``model.layers``, ``transformer.h``,
    ``encoder.layer``, ...), whatever the family names it."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(lists, key=len)


def _data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(2)]


def _reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for ids in _data():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipelined(kind: str, auto: bool, split: bool = False) -> tuple[list[float], dict[str, torch.Tensor], list[int]]:
    """``split``: the cut runs through the middle layer, between its attention (rank 0, with the
    layer's own code and residual adds) and its MLP (rank 1), as automatic partitioning may cut."""
    import smp.torch as smp

    cfg: dict[str, Any] = {"pipeline_parallel_degree": 2, "microbatches": 2, "auto_partition": auto,
                           "comm_timeout": 60.0}
    if not auto:
        cfg["default_partition"] = 0
    smp.init(cfg)
    hf = _model(kind)
    model = smp.DistributedModel(hf)
    if not auto:
        layers = _layers(hf)
        for layer in layers[len(layers) // 2:]:
            smp.set_partition(layer, 1)
        if split:
            middle = layers[len(layers) // 2 - 1]
            # after the attention: Llama-like, GPT-2 (ln_2, mlp), GPT-J (mlp), BERT (intermediate, output)
            for name in ("post_attention_layernorm", "mlp", "block_sparse_moe", "ln_2", "intermediate", "output"):
                if hasattr(middle, name):
                    smp.set_partition(getattr(middle, name), 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    losses = []
    for ids in _data():
        opt.zero_grad()
        losses.append(train_step(model, ids).reduce_mean().item())
        opt.step()
    return losses, model.state_dict(), list(next(iter(model.plans.values())).chain)


@pytest.mark.parametrize("kind", ["llama", "gpt_neox", "mistral", "mixtral", "qwen2", "gpt2", "gptj", "falcon", "bert",
                                  "roberta"])
def test_hf_model_pipelined_matches_one_process(kind: str) -> None:
    ref_losses, ref_state = _reference(kind)
    chains = {}
    for auto, split in ((False, False), (False, True), (True, False)):
        losses, state, chains[auto, split] = run_ranks(_pipelined, 2, args=(kind, auto, split), timeout=180)[0]
        # microbatches of 2: the loss is the mean of per-microbatch means (equal token counts)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    # Cutting inside a layer adds no hop: the microbatch still goes 0 -> 1 (and back for the loss).
    # (Falcon's layer adds its MLP's output to its attention's in place, on rank 1 where the MLP ran:
    # Note [in-place on a reference] in engine/refs.py.)
    assert chains[False, True] == chains[False, False], chains
