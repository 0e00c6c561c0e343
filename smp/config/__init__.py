"""Configuration: every SMP v1 key (plus v2 and smp keys), sources, validation, defaults."""

from smp.config.resolve import (
    ENV_VAR,
    Config,
    PartitionSection,
    PipelineSection,
    load_env,
    load_source,
    resolve,
)
from smp.config.schema import ALIASES, KEYS, KEYS_BY_NAME, PIPELINE_NAMES, PLACEMENT_NAMES, Key

__all__ = [
    "ALIASES",
    "ENV_VAR",
    "KEYS",
    "KEYS_BY_NAME",
    "PIPELINE_NAMES",
    "PLACEMENT_NAMES",
    "Config",
    "Key",
    "PartitionSection",
    "PipelineSection",
    "load_env",
    "load_source",
    "resolve",
]
