"""The one exception hierarchy for user-facing errors (STYLE.md habit 12)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SMPError",
    "SMPConfigError",
    "SMPValidationError",
    "SMPInvalidArgumentError",
    "ConfigProblem",
    "flag_arguments",
    "NotInitializedError",
    "ScheduleError",
    "PartitionError",
    "InvalidPartitionIDError",
    "PartitionMemoryError",
    "CommTimeoutError",
    "RemoteRankError",
    "InvalidCommGroupError",
]


class SMPError(Exception):
    """Base class of every error smp raises on purpose."""


@dataclass(frozen=True)
class ConfigProblem:
    """One problem found in a configuration: which key, what value, which rule, and the fix."""

    key: str
    value: object
    rule: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}={self.value!r}: {self.rule}. Fix: {self.fix}"


class SMPConfigError(SMPError, ValueError):
    """A configuration is invalid. Lists every problem at once.

    Example:
        >>> try:
        ...     raise SMPConfigError([ConfigProblem("microbatches", 0, "must be >= 1", "use 1 or more")])
        ... except ValueError as e:
        ...     print(e.problems[0].key)
        microbatches
    """

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = list(problems)
        lines = [f"invalid smp configuration ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        super().__init__("\n".join(lines))


# SMP v1 names for the same error, so `except smp.exceptions.SMPValidationError` keeps working.
SMPValidationError = SMPConfigError
SMPInvalidArgumentError = SMPConfigError


def flag_arguments(where: str, **flags: object) -> dict[str, bool]:
    """Method arguments that are truth values, as bools: what SMP v1 (and Python's ``if``) accepts.

    Strict types belong to config keys; a method argument takes a bool or an int (an argparse
    ``type=int`` flag such as ``gather_if_shard=args.gather_if_shard``). A string is refused: ``"0"``
    and ``"False"`` are true in Python, which is never what the script meant.

    Example:
        >>> flag_arguments("optimizer.local_state_dict", gather_if_shard=0, cast_to_cpu=True)
        {'gather_if_shard': False, 'cast_to_cpu': True}

    Raises:
        SMPInvalidArgumentError: every argument that is neither a bool nor an int.
    """
    bad = [ConfigProblem(f"{where}({name}=...)", value, "must be a bool or an int (a truth value)",
                         "pass True or False (or 1 or 0)")
           for name, value in flags.items() if not isinstance(value, (bool, int)) and not _is_integer(value)]
    if bad:
        raise SMPInvalidArgumentError(bad)
    return {name: bool(value) for name, value in flags.items()}


def _is_integer(value: object) -> bool:
    """A NumPy integer or bool (``np.int64(1)``) without importing NumPy."""
    return type(value).__module__ == "numpy" and hasattr(value, "__index__")


class NotInitializedError(SMPError, RuntimeError):
    """A rank function was called before `smp.init()`."""


class ScheduleError(SMPError, ValueError):
    """A pipeline plan is invalid or cannot be built; the message shows the plan."""


class PartitionError(SMPError, ValueError):
    """A partition request is invalid or has no solution; the message shows the partition."""


class CommTimeoutError(SMPError, TimeoutError):
    """A wait on another rank ran past the communication timeout."""


class RemoteRankError(SMPError, RuntimeError):
    """Another rank failed; carries that rank and its original traceback.

    ``who`` names the rank as it described itself ("rank 3 (pp_rank 1, ...; pid 7 on host h2)"): its
    coordinates and host, so the log of every rank says where to look.
    """

    def __init__(self, rank: int, message: str, who: str = "") -> None:
        self.rank = rank
        self.remote_message = message
        super().__init__(f"{who or f'rank {rank}'} failed:\n{message}")


class InvalidCommGroupError(SMPError, ValueError):
    """A communication group argument is not one of the CommGroup values."""


class InvalidPartitionIDError(PartitionError):
    """A partition index (``smp.partition(i)``, ``set_partition``, ``default_partition``) is not in [0, pp)."""


class PartitionMemoryError(PartitionError):
    """No partition keeps every rank under its memory limit; the message shows the best split found."""


class TensorSplitError(SMPError, ValueError):
    """``smp.step`` cannot split its arguments into microbatches (bad ``non_split_inputs`` /
    ``input_split_axes``, or a tensor whose size along its split axis is not divisible by the
    number of microbatches). SMP v1 name."""


class StepOutputError(SMPError, ValueError):
    """The per-microbatch return values of a step function cannot be aggregated (their structure
    differs between microbatches), or a `StepOutput` reduction has nothing to reduce."""


class SMPCheckpointError(SMPError, RuntimeError):
    """A checkpoint cannot be written or read: bad tag, missing file, incomplete save. SMP v1 name."""


__all__ += ["TensorSplitError", "StepOutputError", "SMPCheckpointError"]


class PeerLostError(RemoteRankError):
    """Another rank's process is gone (killed, crashed in native code, frozen, or exited mid-job).

    ``rank`` is the rank that is gone, not the rank that noticed; the message says how it was
    detected (a heartbeat that stopped, an exit without an error, the job's store vanishing) and
    what to check.
    """

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.remote_message = message
        Exception.__init__(self, message)


class PeerStalledError(CommTimeoutError, RemoteRankError):
    """Another rank is alive (its heartbeat goes on) but did not answer within ``comm_timeout``.

    ``rank`` is the silent rank. Also a `CommTimeoutError` (and so a ``TimeoutError``).
    """

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.remote_message = message
        Exception.__init__(self, message)


__all__ += ["PeerLostError", "PeerStalledError"]


class LaunchError(SMPError, RuntimeError):
    """The launch environment is incomplete (e.g. an MPI job without a way to rendezvous)."""


__all__ += ["LaunchError"]
