"""The torch runtime: `init` and the process groups, the rank API, the failure binding, process state.

- `init`: ``smp.init`` / ``smp.reset`` / ``smp.shutdown``, `TorchRuntime` (the groups of this process);
- `comm`: the SMP v1 rank API, ``get_*_group``, object collectives (``send``, ``allgather``, ...);
- `failure`: the core's failure protocol bound to torch.distributed's store and work handles;
- `process_state`: `TorchState`, the frontend's process-wide state (and what a reset keeps).

The re-exports below are for callers outside ``smp.torch``; modules inside import the real
module. `init` itself is not re-exported: the name would hide the submodule ``runtime.init``
(``import smp.torch.runtime.init as m`` would bind the function). ``smp.torch.init`` is the public
name.
"""

from .init import TorchRuntime, is_initialized, reset, runtime, shutdown

__all__ = ["TorchRuntime", "is_initialized", "reset", "runtime", "shutdown"]
