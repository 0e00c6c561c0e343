"""One rank of a `tests.helpers.mpi_spawn.run_mpi_ranks` job: run the named function, write what it gave.

``python -m tests.helpers._mpi_child <payload.pkl> <result dir>``. The result goes to
``<result dir>/rank<R>.pkl`` as ``("ok", value)`` or ``("error", traceback text)``, written to a
temporary name and renamed, so the parent never reads half a file. After an error the exception
is raised again, so whatever ``sys.excepthook`` smp installed (publish the failure, end the job)
runs as it would in a user's script.
"""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import sys
import traceback
from typing import Any


def _rank() -> int:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def _write(result_dir: str, rank: int, record: tuple[str, Any]) -> None:
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        data = pickle.dumps(record)
    except Exception as e:  # noqa: BLE001 - an unpicklable return value is reported, not lost
        data = pickle.dumps(("error", f"rank {rank}: the return value could not be pickled: {e!r}"))
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def main() -> None:
    payload_path, result_dir = sys.argv[1], sys.argv[2]
    with open(payload_path, "rb") as f:
        payload = pickle.load(f)
    rank = _rank()
    # A rank still running shortly before the parent gives up prints where it is stuck.
    faulthandler.dump_traceback_later(max(1.0, payload["timeout"] - 3.0), exit=False)
    fn: Any = importlib.import_module(payload["module"])
    for part in payload["qualname"].split("."):
        fn = getattr(fn, part)
    try:
        value = fn(*payload["args"], **payload["kwargs"])
    except BaseException as e:
        _write(result_dir, rank, ("error", "".join(traceback.format_exception(type(e), e, e.__traceback__))))
        faulthandler.cancel_dump_traceback_later()
        raise
    _write(result_dir, rank, ("ok", value))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
