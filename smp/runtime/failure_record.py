"""The failure record: what the job's store says went wrong, on which rank, and the error each rank raises.

One key (``failure``) holds the first failure of the job, written with compare-and-set so the first
report wins. Its first line names the rank *at fault*, which is not always the rank that wrote it:

    ``3 failed 3``   rank 3 raised; the text is its traceback
    ``3 lost 1``     rank 1 found rank 3's process gone (heartbeat stopped, exit mid-job, store gone)
    ``1 stalled 0``  rank 0 waited ``comm_timeout`` for rank 1, which is alive but did not answer

Records from before the kind existed (``"3\\n<traceback>"``) read as ``failed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp.errors import PeerLostError, PeerStalledError, RemoteRankError

__all__ = ["FAILED", "LOST", "STALLED", "FailureRecord", "is_transport_error"]

FAILED, LOST, STALLED = "failed", "lost", "stalled"

# What gloo (and NCCL, and the TCP store) say when the other end of a connection went away.
_TRANSPORT_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
                      "socket closed", "read error", "write error", "econnreset", "epipe", "nccl communicator was aborted",
                      "connection was forcibly closed", "transport endpoint is not connected")


def is_transport_error(text: str) -> bool:
    """Whether an error text is a dropped connection rather than a failure of this rank's own code.

    Example:
        >>> is_transport_error("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        True
        >>> is_transport_error("size mismatch for weight")
        False
    """
    low = text.lower()
    return any(m in low for m in _TRANSPORT_MARKERS)


@dataclass(frozen=True)
class FailureRecord:
    """The job's first failure.

    Attributes:
        rank: the rank at fault (it raised, is gone, or did not answer).
        kind: FAILED, LOST or STALLED.
        reporter: the rank that wrote the record.
        text: the traceback (FAILED) or the explanation (LOST, STALLED).
        who: how the failed rank named itself (coordinates, pid and host; FAILED records), or "".
    """

    rank: int
    kind: str
    reporter: int
    text: str
    who: str = ""

    def encode(self) -> str:
        who = self.who.replace("\t", " ").replace("\n", " ")
        return f"{self.rank} {self.kind} {self.reporter}" + (f"\t{who}" if who else "") + f"\n{self.text}"

    @staticmethod
    def decode(raw: str) -> FailureRecord:
        """Read a record; unreadable heads give rank -1 rather than an error while the job fails.

        Example:
            >>> FailureRecord.decode("3 lost 1\\nrank 3 is gone").kind
            'lost'
            >>> FailureRecord.decode("2\\nTraceback ...").rank
            2
            >>> FailureRecord.decode("2 failed 2\\trank 2 (pid 9 on host b)\\nTraceback ...").who
            'rank 2 (pid 9 on host b)'
        """
        head, _, text = raw.partition("\n")
        head, _, who = head.partition("\t")
        parts = head.split()
        rank = int(parts[0]) if parts and parts[0].lstrip("-").isdigit() else -1
        kind = parts[1] if len(parts) > 1 and parts[1] in (FAILED, LOST, STALLED) else FAILED
        reporter = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else rank
        return FailureRecord(rank, kind, reporter, text, who)

    def error_for(self, me: int) -> RemoteRankError | None:
        """The error rank ``me`` raises for this record, or None for its own failure (it raises that itself)."""
        if self.kind == LOST:
            return PeerLostError(self.rank, self.text if self.reporter == me else
                                 f"{self.text}\n(reported by rank {self.reporter})")
        if self.kind == STALLED:
            if self.rank == me:
                return PeerStalledError(me, f"rank {self.reporter} reported this rank ({me}) as not answering; "
                                            f"this rank stops too. Its report:\n{self.text}")
            return PeerStalledError(self.rank, self.text if self.reporter == me else
                                    f"{self.text}\n(reported by rank {self.reporter})")
        if self.rank == me:
            return None
        return RemoteRankError(self.rank, self.text, self.who)
