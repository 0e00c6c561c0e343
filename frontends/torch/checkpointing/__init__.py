"""Checkpoints for PyTorch: the core's checkpoint layout bound to ``torch.save`` / ``torch.load``.

- `saving`: ``smp.save`` / ``smp.load``, ``smp.save_checkpoint`` / ``smp.resume_from_checkpoint``,
  and the resumed state a model or optimizer takes (`saving.take_pending`);
- `files`: the torch binding of `smp.checkpoint` (atomic ``torch.save``, `TorchCodec`, the verbs
  that write and read checkpoint files).
"""
