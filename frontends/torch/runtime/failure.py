"""The failure protocol bound to torch.distributed: the job's store and work handles go into the core's channel.

The procedure (publish, detect, name the rank, wait with a timeout) is `smp.runtime.failure`; this
module opens its channel on torch's store and re-exports its verbs for the frontend, whose waits
pass torch.distributed ``Work`` handles to `wait`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from smp.runtime.failure import (
    DEAD_AFTER_S,
    HEARTBEAT_S,
    FailureChannel,
    channel,
    check_peers,
    publish_failure,
    set_channel,
    stalled_error,
    timeout_error,
    translate,
    wait,
)

__all__ = ["DEAD_AFTER_S", "HEARTBEAT_S", "FailureChannel", "channel", "check_peers", "open_channel",
           "publish_failure", "set_channel", "stalled_error", "timeout_error", "translate", "wait"]


def open_channel(store: dist.Store | None, rank: int, timeout_s: float,
                 describe: Callable[[int], str] | None = None) -> FailureChannel:
    """This process's failure channel on the job's store (its keys under the ``smp`` prefix), made current."""
    ch = FailureChannel(dist.PrefixStore("smp", store) if store is not None else None, rank, timeout_s, describe)
    set_channel(ch)
    return ch
