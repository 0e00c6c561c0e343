"""The Hugging Face model families `transform` converts, and what each needs checked first.

A family is keyed by ``config.model_type``. Its TP layout comes from the config's
``base_model_tp_plan`` (so a related model with the same plan converts the same way); the
family adds the head-count checks the plan does not express (a head must never be split across
ranks; with grouped-query attention the key/value heads are split too), and the attention modules
whose dropout must run on the TP-region generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelFamily", "MODEL_FAMILIES", "family_for", "check_config"]


def _heads_problems(config: Any, tp: int) -> list[str]:
    problems = []
    heads = int(config.num_attention_heads)
    if heads % tp:
        problems.append(f"num_attention_heads={heads} is not divisible by tensor_parallel_degree={tp}: "
                        "each rank must hold whole attention heads")
    kv = getattr(config, "num_key_value_heads", None)
    if kv is not None and int(kv) % tp:
        problems.append(f"num_key_value_heads={kv} is not divisible by tensor_parallel_degree={tp}: with "
                        "grouped-query attention each rank holds num_key_value_heads / tp key/value heads "
                        "(replicating key/value heads is not supported)")
    return problems


def _mlp_problems(config: Any, tp: int) -> list[str]:
    inter = getattr(config, "intermediate_size", None)
    if inter is not None and int(inter) % tp:
        return [f"intermediate_size={inter} is not divisible by tensor_parallel_degree={tp}"]
    return []


def _vocab_problems(config: Any, tp: int) -> list[str]:
    vocab = int(config.vocab_size)
    if vocab % tp:
        padded = -(-vocab // tp) * tp
        return [f"vocab_size={vocab} is not divisible by tensor_parallel_degree={tp} (the embedding and LM "
                f"head are split by vocabulary); pad it, e.g. model.resize_token_embeddings({padded})"]
    return []


@dataclass(frozen=True)
class ModelFamily:
    """One supported family: its ``model_type``, checks, and attention-module path pattern."""

    model_type: str
    attention: str
    checks: tuple[Callable[[Any, int], list[str]], ...] = (_heads_problems, _mlp_problems, _vocab_problems)
    # The TP plan when the config has none (GPT-2); otherwise the config's base_model_tp_plan.
    plan: tuple[tuple[str, str], ...] = ()
    # Divide the attention modules' own head counts (num_heads, num_attention_heads,
    # num_key_value_heads) by tp: for models read from their plan, whose attention may reshape with
    # a stored head count instead of -1 (GPT-J).
    local_heads: bool = False


MODEL_FAMILIES: dict[str, ModelFamily] = {
    "llama": ModelFamily("llama", "layers.*.self_attn"),
    "mistral": ModelFamily("mistral", "layers.*.self_attn"),
    "mixtral": ModelFamily("mixtral", "layers.*.self_attn"),
    "gpt_neox": ModelFamily("gpt_neox", "layers.*.attention"),
    # GPT-2's config has no base_model_tp_plan and its projections are Conv1D (weight (in, out)).
    "gpt2": ModelFamily("gpt2", "h.*.attn", plan=(
        ("h.*.attn.c_attn", "conv1d_qkv_colwise"), ("h.*.attn.c_proj", "conv1d_rowwise"),
        ("h.*.mlp.c_fc", "conv1d_colwise"), ("h.*.mlp.c_proj", "conv1d_rowwise"))),
}


def _from_plan(config: Any) -> ModelFamily | None:
    """A family for a model type not listed above whose ``base_model_tp_plan`` uses only the styles
    smp implements and names its attention projections (``<path>.q_proj`` or
    ``<path>.query_key_value``), e.g. Qwen2, Qwen3, Gemma: the same code covers related models."""
    from .styles import STYLES

    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan or any(style not in STYLES for style in plan.values()):
        return None
    for pattern in plan:
        head, _, leaf = pattern.rpartition(".")
        if leaf in ("q_proj", "query_key_value") and head:
            return ModelFamily(str(config.model_type), head, local_heads=True)
    return None


def family_for(config: Any) -> ModelFamily:
    """The family of ``config.model_type`` (or one read from its ``base_model_tp_plan``); an
    unsupported type lists the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in MODEL_FAMILIES:
        return MODEL_FAMILIES[model_type]
    family = _from_plan(config)
    if family is None:
        from .styles import STYLES

        plan = getattr(config, "base_model_tp_plan", None) or {}
        unknown = sorted({s for s in plan.values() if s not in STYLES})
        why = (f"its base_model_tp_plan uses styles smp does not implement: {unknown}" if unknown
               else "its config has no usable base_model_tp_plan")
        raise ValueError(f"model_type={model_type!r} has no tensor-parallel converter ({why}); supported: "
                         f"{sorted(MODEL_FAMILIES)} and models whose base_model_tp_plan uses only "
                         f"{sorted(STYLES)}. Fix: use one of those, or mark your own modules with "
                         "smp.torch.nn layers")
    return family


def check_config(config: Any, tp: int) -> list[str]:
    """Every reason ``config`` cannot be split ``tp`` ways (empty when it can).

    Example:
        >>> from types import SimpleNamespace
        >>> cfg = SimpleNamespace(model_type="llama", num_attention_heads=4, num_key_value_heads=1,
        ...                       intermediate_size=8, vocab_size=10)
        >>> [p.split(" is")[0] for p in check_config(cfg, 2)]
        ['num_key_value_heads=1']
    """
    family = family_for(config)
    return [p for check in family.checks for p in check(config, tp)]
