"""smp: model-parallel training with the SageMaker model parallelism v1 programming model.

The core (this package) is framework-free: it never imports torch or tensorflow.
Frameworks live in `smp.torch` (see frontends/torch).
"""

from smp.errors import SMPConfigError, SMPError

__version__ = "0.1.0"

__all__ = ["SMPError", "SMPConfigError", "__version__"]
