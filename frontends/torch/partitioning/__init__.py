"""Partitioning for PyTorch: which pipeline rank owns each module.

- `scopes`: ``smp.partition`` / ``smp.set_partition``, recorded for the core's `PartitionScopes`;
- `trace`: one traced microbatch, the module tree lowered to the core's `ModuleTree`, automatic
  partitioning;
- `decide`: the decision ``smp.DistributedModel`` applies (saved, automatic or manual);
- `hf_plan`: ``smp plan --hf-config``, a partition and schedule for a Hugging Face config without
  building the model.
"""
