"""Tensor parallelism for whole models: marking (SMP v1), registration, and Hugging Face conversion.

``smp.torch`` re-exports `nn`, `tensor_parallelism`, `set_tensor_parallelism`, `tp_register`,
`tp_register_with_module` and `transform`; `apply_tensor_parallelism` is what
``smp.DistributedModel`` calls to replace the marked modules.
"""

from smp.torch import nn

from .convert import transform
from .hf_checkpoint import full_hf_state_dict, load_hf_checkpoint, save_pretrained
from .marking import (
    DistributedModelWrappedError,
    apply_tensor_parallelism,
    is_marked,
    set_tensor_parallelism,
    tensor_parallelism,
)
from .models import MODEL_FAMILIES
from .registry import REGISTRY, tp_register, tp_register_with_module
from .styles import STYLES

__all__ = [
    "MODEL_FAMILIES",
    "REGISTRY",
    "STYLES",
    "DistributedModelWrappedError",
    "apply_tensor_parallelism",
    "full_hf_state_dict",
    "load_hf_checkpoint",
    "is_marked",
    "nn",
    "save_pretrained",
    "set_tensor_parallelism",
    "tensor_parallelism",
    "tp_register",
    "tp_register_with_module",
    "transform",
]
