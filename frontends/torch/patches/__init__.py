"""SMP v1 import paths kept for scripts (``smp.torch.patches.checkpoint``)."""
