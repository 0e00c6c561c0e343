"""Round-trip cost of smp.tensorflow's Transport (not a test: the figures in transport.py's docstring).

Run: ``.venv/bin/mpiexec -n 2 .venv/bin/python -m tests.tensorflow.runtime.bench_transport``
(with TF_CPP_MIN_LOG_LEVEL=3 TF_ENABLE_ONEDNN_OPTS=0 OMP_NUM_THREADS=1). Rank 0 prints, per size,
the median and 90th percentile of 200 round trips (``isend`` + ``recv`` each way + ``flush``, after
20 warm-up trips) and the median of 100 ``allreduce_mean`` calls over the 2 ranks.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def main() -> None:
    import smp.tensorflow as smp
    from smp.tensorflow.runtime.init import runtime

    from smp.topology import GroupKind

    smp.init({"pipeline_parallel_degree": 2})
    t = runtime().transport
    assert t is not None
    me = smp.rank()
    for nbytes in (4096, 1 << 20):
        a = np.ones(nbytes // 4, np.float32)
        trips = []
        for i in range(220):
            t0 = time.perf_counter()
            if me == 0:
                t.isend(a, 1, 5, "ping")
                t.recv(a.shape, np.float32, 1, 6, "pong")
            else:
                b = t.recv(a.shape, np.float32, 0, 5, "ping")
                t.isend(b, 0, 6, "pong")
            t.flush("round trip")
            if i >= 20:
                trips.append(time.perf_counter() - t0)
        reduces = []
        for i in range(120):
            t0 = time.perf_counter()
            t.allreduce_mean(a, GroupKind.PP)
            if i >= 20:
                reduces.append(time.perf_counter() - t0)
        if me == 0:
            p90 = sorted(trips)[int(0.9 * len(trips))]
            print(f"{nbytes // 1024:5d} KiB  round trip median {statistics.median(trips) * 1e6:8.1f} us  "
                  f"p90 {p90 * 1e6:8.1f} us   allreduce_mean median {statistics.median(reduces) * 1e6:8.1f} us",
                  flush=True)
    smp.reset()


if __name__ == "__main__":
    main()
