"""Runtime protocol of the core: peer liveness (heartbeats over the job's store) and the failure record."""

from smp.runtime.failure_record import FAILED, LOST, STALLED, FailureRecord, is_transport_error
from smp.runtime.liveness import EXITED, Heartbeat, PeerState, Store, local_process_gone

__all__ = ["EXITED", "FAILED", "LOST", "STALLED", "FailureRecord", "Heartbeat", "PeerState", "Store",
           "is_transport_error", "local_process_gone"]
