"""Memory per rank against one process: does model parallelism divide memory? Both frontends.

Each configuration is launched as users launch it (``torchrun`` for smp.torch, ``mpiexec`` for
smp.tensorflow, plain ``python`` for the one-process baseline, which uses no smp at all), trains
3 optimizer steps (Adam; the optimizer step inside), and every rank reports its resident memory
growth over its own start (after imports and ``smp.init``): the peak (``ru_maxrss``) and the
steady value after the last step. Fixed costs (interpreter, frameworks, threads) cancel in the
*marginal* figure: the growth of a model with 2L layers minus that of L layers, per rank, divided
by the same difference in one process. Ideal: 1/pp (0.5 at pp 2, 0.25 at pp 4).

Models (layers of a fixed width, the rest of each model fixed):

- ``mlp``: ``Linear(2048, 2048)`` / ``Dense(2048)`` layers, 8 vs 16; placed by hand with
  ``smp.partition(i)`` blocks (consecutive slices of the layers);
- ``gpt``: the ``ModuleList`` GPT of ``examples/gpt_model.py`` (width 512), 4 vs 8 blocks,
  automatic partition;
- ``llama``: an unmodified HF ``LlamaForCausalLM`` (hidden 512, GQA 8/4, vocab 8192), 4 vs 8
  layers, called with ``labels=``, automatic partition;
- ``keras``: the TF demo's character transformer (``examples/tensorflow/train_keras.py``, width 512),
  4 vs 8 blocks, automatic partition.

The torch MLP runs twice at pp > 1: with smp's defaults (``optimize: "speed"``, whose heap keeps
freed blocks for the next step) and with ``optimize: "memory"`` (large blocks go back to the kernel;
see ``frontends/torch/runtime/heap.py``). The TensorFlow MLP runs twice at pp > 1: lockstep (the
default for ranks that share the cores, as ``mpiexec`` starts them here) and with the overlap
(``SMP_TF_OVERLAP=1``, the default for ranks bound to their cores, e.g. by Open MPI). The median of
``--launches`` launches is taken for every figure. Then the line a user cares about
(``--limit``): the most ``mlp`` layers that train under a hard per-process memory limit, one
process against pp 2 and pp 4, both frontends. Each process puts itself, before it imports
anything, in a memory cgroup of its own whose limit is the per-process limit (the kernel ends a
process that outgrows it), where the cgroup (v1) memory controller is writable, as it is for root
on our machines; elsewhere torch's processes run under ``RLIMIT_DATA`` instead, and TensorFlow is
left out: its allocations escape ``RLIMIT_DATA`` (a Keras process trained 80 ``Dense(2048)`` layers
with Adam, several GiB, under a 2 GiB limit), and the search stops with an error when a process
outgrows the limit.

Run::

    .venv/bin/python benchmarks/bench_memory.py                      # everything (about 30 minutes)
    .venv/bin/python benchmarks/bench_memory.py --models mlp --pp 2 --launches 1 --no-limit   # quick look

The rows and tables are saved as ``benchmarks/results/bench_memory.json`` (`records`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
WIDTH = {"mlp": 2048, "gpt": 512, "llama": 512, "keras": 512}
LAYERS = {"mlp": (8, 16), "gpt": (4, 8), "llama": (4, 8), "keras": (4, 8)}
FRONTEND = {"mlp": ("torch", "tensorflow"), "gpt": ("torch",), "llama": ("torch",), "keras": ("tensorflow",)}
STEPS = 3
MICROBATCHES = int(os.environ.get("SMP_BENCH_MICROBATCHES", "4"))
LIMIT_ENV = "SMP_BENCH_DATA_LIMIT"
CGROUP_ENV = "SMP_BENCH_CGROUP"  # a memory cgroup directory: each process of a launch makes its own, limited, in it
CGROUP_ROOT = "/sys/fs/cgroup/memory"  # the cgroup v1 memory controller
OPTIMIZE_ENV = "SMP_BENCH_OPTIMIZE"
SETTING_LABEL = {"memory": "optimize: memory", "overlap": "overlap, as with ranks bound to cores"}


# --- one process of a launch ---------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _torch_child(model_name: str, layers: int, pp: int) -> dict[str, Any]:
    import torch
    from torch import nn

    smp = None
    if pp:
        import smp.torch as smp

        # Under the memory limit the model is built as a user builds one too big for a process:
        # with delayed parameter initialisation (no rank allocates what another owns).
        smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES,
                  "auto_partition": model_name != "mlp", "default_partition": 0,
                  "optimize": os.environ.get(OPTIMIZE_ENV, "speed")})
    base = _rss()
    torch.manual_seed(0)
    width = WIDTH[model_name]
    if model_name == "mlp":
        class Deep(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                stages = []
                for s in range(max(pp, 1)):
                    count = layers // max(pp, 1)
                    if smp is not None:
                        with smp.partition(s):
                            stages.append(nn.Sequential(*[nn.Linear(width, width) for _ in range(count)]))
                    else:
                        stages.append(nn.Sequential(*[nn.Linear(width, width) for _ in range(count)]))
                self.stages = nn.ModuleList(stages)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for stage in self.stages:
                    x = stage(x)
                return x

        if smp is not None:
            with smp.delay_param_initialization(enabled=bool(os.environ.get(LIMIT_ENV))):
                net: nn.Module = Deep()
        else:
            net = Deep()
        batch = torch.randn(8, width)

        def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
            return model(x).pow(2).mean()
    elif model_name == "gpt":
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from gpt_model import GPT, lm_loss

        net = GPT(vocab=4096, width=width, layers=layers, heads=8, seq=128)
        batch = torch.randint(0, 4096, (8, 129), generator=torch.Generator().manual_seed(0))

        def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
            return lm_loss(model(x[:, :-1]), x[:, 1:])
    else:
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=width, intermediate_size=1376,
                                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=128, use_cache=False)
        net = transformers.LlamaForCausalLM(cfg)
        batch = torch.randint(0, 8192, (8, 128), generator=torch.Generator().manual_seed(0))

        def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
            return model(input_ids=x, labels=x).loss

    if smp is None:
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        for _ in range(STEPS):
            opt.zero_grad()
            loss_of(net, batch).backward()
            opt.step()
        rank = 0
    else:
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))

        @smp.step
        def train_step(model: Any, x: torch.Tensor) -> torch.Tensor:
            loss = loss_of(model, x)
            model.backward(loss)
            return loss

        for _ in range(STEPS):
            opt.zero_grad()
            train_step(model, batch)
            opt.step()
        rank = smp.rank()
    return {"rank": rank, "peak": _peak() - base, "steady": _rss() - base}


def _tf_child(model_name: str, layers: int, pp: int) -> dict[str, Any]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    smp = None
    if pp:
        import smp.tensorflow as smp

        smp.init({"pipeline_parallel_degree": pp, "microbatches": MICROBATCHES,
                  "auto_partition": model_name != "mlp", "default_partition": 0})
    base = _rss()
    keras.utils.set_random_seed(0)
    width = WIDTH[model_name]
    base_class = smp.DistributedModel if smp is not None else keras.Model
    if model_name == "mlp":
        class Deep(base_class):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                super().__init__()
                self.blocks = [keras.layers.Dense(width) for _ in range(layers)]

            def call(self, x: Any) -> Any:
                for i, block in enumerate(self.blocks):
                    if smp is not None:
                        with smp.partition(i * pp // layers):
                            x = block(x)
                    else:
                        x = block(x)
                return x

        model = Deep()
        batch = (np.random.default_rng(0).standard_normal((8, width)).astype(np.float32),)

        def loss_of(x: Any) -> Any:
            return tf.reduce_mean(tf.square(model(x)))
    else:
        sys.path.insert(0, os.path.join(ROOT, "examples", "tensorflow"))
        from train_keras import VOCAB, make_model

        model = make_model(base_class, width, layers, 8, 128)
        ids = np.random.default_rng(0).integers(0, VOCAB, (8, 129)).astype(np.int32)
        batch = (ids[:, :-1], ids[:, 1:])
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def loss_of(x: Any, y: Any) -> Any:
            return xent(y, model(x))

    opt = keras.optimizers.Adam(1e-4)
    if smp is None:
        @tf.function
        def train_step(*xs: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of(*xs)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss
    else:
        @smp.step
        def get_grads(*xs: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of(*xs)
            return tape.gradient(loss, model.trainable_variables), loss

        @tf.function
        def train_step(*xs: Any) -> Any:
            grads, loss = get_grads(*xs)
            opt.apply_gradients(zip([g.accumulate() for g in grads], model.trainable_variables))
            return loss.reduce_mean()
    for _ in range(STEPS):
        train_step(*[tf.constant(x) for x in batch])
    rank = smp.rank() if smp is not None else 0
    return {"rank": rank, "peak": _peak() - base, "steady": _rss() - base}


def _enter_cgroup(parent: str, limit: int) -> None:
    """This process alone in a new memory cgroup in ``parent``, limited to ``limit`` bytes (swap included
    where the kernel counts it): the kernel ends the process when it outgrows the limit."""
    mine = os.path.join(parent, str(os.getpid()))
    os.mkdir(mine)
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        if os.path.exists(os.path.join(mine, name)):
            with open(os.path.join(mine, name), "w") as f:
                f.write(str(limit))
    with open(os.path.join(mine, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def cgroup_available() -> bool:
    """Whether this process may make memory cgroups (`_enter_cgroup`)."""
    return os.access(CGROUP_ROOT, os.W_OK) and os.path.exists(os.path.join(CGROUP_ROOT, "memory.limit_in_bytes"))


def child(argv: list[str]) -> None:
    frontend, model_name, layers, pp, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    limit = os.environ.get(LIMIT_ENV)
    if limit and os.environ.get(CGROUP_ENV):  # before anything is imported: the whole process lives under it
        _enter_cgroup(os.environ[CGROUP_ENV], int(limit))
    elif limit:
        resource.setrlimit(resource.RLIMIT_DATA, (int(limit), int(limit)))
    run = _torch_child if frontend == "torch" else _tf_child
    got = run(model_name, layers, pp)
    with open(f"{out}_{got['rank']}.json", "w") as f:
        json.dump(got, f)


# --- launches --------------------------------------------------------------------------------------

def launch(frontend: str, model_name: str, layers: int, pp: int, limit: int | None = None,
           timeout: float = 600, optimize: str = "speed", cgroup: bool = False) -> list[dict[str, Any]] | None:
    """One launch; each rank's figures by rank, or None when it failed (under ``limit``: out of memory).

    ``cgroup``: the limit is each process's own memory cgroup (`_enter_cgroup`), not ``RLIMIT_DATA``."""
    if limit is not None and cgroup:
        parent = tempfile.mkdtemp(prefix="smp-bench-", dir=CGROUP_ROOT)  # a cgroup: the kernel fills it
        try:
            return _launch(frontend, model_name, layers, pp, limit, timeout, optimize, parent)
        finally:
            for _ in range(50):  # the last process may still be leaving its cgroup
                try:
                    for mine in [e.path for e in os.scandir(parent) if e.is_dir()]:
                        os.rmdir(mine)
                    os.rmdir(parent)
                    break
                except OSError:
                    time.sleep(0.1)
    return _launch(frontend, model_name, layers, pp, limit, timeout, optimize, None)


def _launch(frontend: str, model_name: str, layers: int, pp: int, limit: int | None, timeout: float,
            optimize: str, cgroup: str | None) -> list[dict[str, Any]] | None:
    me = os.path.abspath(__file__)
    bin_dir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory(prefix="smp-mem-") as tmp:
        out = os.path.join(tmp, "rank")
        args = ["--child", frontend, model_name, str(layers), str(pp), out]
        if pp == 0:
            cmd = [sys.executable, me, *args]
        elif frontend == "torch":
            cmd = [os.path.join(bin_dir, "torchrun"), "--nproc-per-node", str(pp), "--master-port",
                   str(_free_port()), me, *args]
        else:
            cmd = [os.path.join(bin_dir, "mpiexec"), "-n", str(pp), sys.executable, me, *args]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "SMP_LOG_LEVEL": "WARNING", "TF_CPP_MIN_LOG_LEVEL": "3",
               OPTIMIZE_ENV: optimize}
        if frontend == "tensorflow" and pp:
            env["SMP_TF_OVERLAP"] = "1" if optimize == "overlap" else "0"
        if limit is not None:
            env[LIMIT_ENV] = str(limit)
        if cgroup is not None:
            env[CGROUP_ENV] = cgroup
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            if limit is None:
                sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            return None
        n = max(pp, 1)
        got = []
        for r in range(n):
            with open(f"{out}_{r}.json") as f:
                got.append(json.load(f))
        return got


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(frontend: str, model_name: str, pp: int, launches: int, optimize: str = "speed") -> dict[str, Any]:
    """Median peak and steady growth per rank of the small and the large model (``pp`` 0: one process)."""
    out: dict[str, Any] = {}
    for layers in LAYERS[model_name]:
        runs = [launch(frontend, model_name, layers, pp, optimize=optimize) for _ in range(launches)]
        ranks = max(pp, 1)
        out[layers] = [{key: statistics.median(run[r][key] for run in runs if run) for key in ("peak", "steady")}
                       for r in range(ranks)]
        out[f"{layers}_spread"] = [[min(run[r]["peak"] for run in runs if run), max(run[r]["peak"] for run in runs
                                                                                   if run)] for r in range(ranks)]
    return out


def largest(frontend: str, pp: int, limit: int, start: int, cgroup: bool = False) -> int:
    """The most ``mlp`` layers (a multiple of max(pp, 1)) that train with every process under ``limit``."""
    step = max(pp, 1)
    ok, bad = 0, None
    layers = max(step, start - start % step)
    while bad is None:  # grow until a launch fails
        got = launch(frontend, "mlp", layers, pp, limit=limit, cgroup=cgroup)
        if got and max(r["peak"] for r in got) > limit:
            sys.exit(f"{frontend}: a process grew by {max(r['peak'] for r in got) / MiB:.0f} MiB under a "
                     f"{limit / MiB:.0f} MiB limit: the limit does not bind its allocator, so the search "
                     "would measure nothing (leave it out of --limit-frontends)")
        if got:
            ok, layers = layers, layers * 2
        else:
            bad = layers
    while bad - ok > step:  # then bisect between the last success and the first failure
        mid = (ok + bad) // 2 // step * step
        if mid <= ok:
            break
        if launch(frontend, "mlp", mid, pp, limit=limit, cgroup=cgroup):
            ok = mid
        else:
            bad = mid
    return ok


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frontends", default="torch,tensorflow")
    p.add_argument("--models", default="mlp,gpt,llama,keras")
    p.add_argument("--pp", default="1,2,4", help="pipeline degrees to run (besides the one-process baseline)")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=MICROBATCHES,
                   help="microbatches of the smp runs (the one-process baseline runs the whole batch)")
    p.add_argument("--limit-mib", type=int, default=2048, help="per-process memory limit of the largest-model line")
    p.add_argument("--no-limit", action="store_true", help="skip the largest-model search")
    p.add_argument("--limit-frontends", default="torch,tensorflow",
                   help="frontends of the largest-model search (TensorFlow only under a memory cgroup)")
    args = p.parse_args(argv)
    cgroup = cgroup_available()
    limit_kind = "memory cgroup" if cgroup else "RLIMIT_DATA"
    os.environ["SMP_BENCH_MICROBATCHES"] = str(args.microbatches)  # the launched processes read it
    frontends = args.frontends.split(",")
    degrees = [int(x) for x in args.pp.split(",")]
    rows: list[dict[str, Any]] = []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from records import Table, write_record

    marginal = Table(f"Marginal memory per rank as a share of one process (peak, steady in brackets; median of "
                     f"{args.launches} launches; ideal 1/pp)",
                     ["frontend", "model", "layers", "pp", "one process", "per rank"])
    limited = Table(f"The most Linear / Dense(2048) layers that train (Adam) with every process under a "
                    f"{args.limit_mib} MiB limit (each process in its own {limit_kind})",
                    ["frontend", "one process", *[f"pp {d}" for d in degrees if d > 1]])
    print(f"marginal growth per rank of {{2L}} minus {{L}} layers, as a share of one process (median of "
          f"{args.launches} launches; ideal 1/pp)\n")
    print(f"{'frontend':<26}{'model':<7}{'layers':>8}{'pp':>4}  {'one process':>12}  per rank: peak share "
          f"(steady share)")
    for model_name in [m for m in args.models.split(",") if m]:
        for frontend in FRONTEND[model_name]:
            if frontend not in frontends:
                continue
            small, large = LAYERS[model_name]
            single = measure(frontend, model_name, 0, args.launches)
            base_peak = single[large][0]["peak"] - single[small][0]["peak"]
            base_steady = single[large][0]["steady"] - single[small][0]["steady"]
            # torch: smp's default heap (optimize: speed) and, for the MLP, optimize: memory (heap.py);
            # TensorFlow: the default here (lockstep: these ranks share the cores) and, for the MLP, the
            # overlap that ranks bound to their cores get by default (engine/schedule.py)
            extra = {"torch": "memory", "tensorflow": "overlap"}[frontend]
            settings = [(pp, "speed") for pp in degrees] + [(pp, extra) for pp in degrees
                                                            if pp > 1 and model_name == "mlp"]
            for pp, optimize in settings:
                got = measure(frontend, model_name, pp, args.launches, optimize)
                label = frontend if optimize == "speed" else f"{frontend} ({SETTING_LABEL[optimize]})"
                shares = [((got[large][r]["peak"] - got[small][r]["peak"]) / base_peak,
                           (got[large][r]["steady"] - got[small][r]["steady"]) / base_steady) for r in range(pp)]
                cells = "  ".join(f"{a:.2f} ({b:.2f})" for a, b in shares)
                marginal.add(label, model_name, f"{small} -> {large}", pp, f"{base_peak / MiB:.0f} MiB", cells)
                print(f"{label:<26} {model_name:<7}{f'{small}->{large}':>8}{pp:>4}  {base_peak / MiB:>8.0f} MiB  "
                      f"{cells}", flush=True)
                rows.append({"kind": "marginal", "frontend": frontend, "optimize": optimize, "model": model_name,
                             "layers": [small, large],
                             "pp": pp, "one_process_mib": {"peak": base_peak / MiB, "steady": base_steady / MiB},
                             "peak_share": [a for a, _ in shares], "steady_share": [b for _, b in shares],
                             "rank_peak_mib": [got[large][r]["peak"] / MiB for r in range(pp)],
                             "rank_peak_spread_mib": [[x / MiB for x in s] for s in got[f"{large}_spread"]],
                             "one_process_peak_mib": single[large][0]["peak"] / MiB})
    if not args.no_limit:
        limit = args.limit_mib * MiB
        print(f"\nthe most Linear/Dense(2048) layers that train (Adam) with every process under a "
              f"{args.limit_mib} MiB limit ({limit_kind})\n")
        for frontend in [f for f in args.limit_frontends.split(",") if f in frontends]:
            if frontend == "tensorflow" and not cgroup:
                print("tensorflow: left out (no writable memory cgroup here, and its allocations escape RLIMIT_DATA)")
                continue
            one = largest(frontend, 0, limit, 4, cgroup)
            found = {0: one}
            for pp in [d for d in degrees if d > 1]:
                found[pp] = largest(frontend, pp, limit, one * pp // 2 or pp, cgroup)
            cells = "  ".join(f"pp {pp}: {n} ({n / one:.1f}x)" for pp, n in found.items() if pp)
            limited.add(frontend, one, *[f"{n} ({n / one:.1f}x)" for pp, n in found.items() if pp])
            print(f"{frontend:<11} one process: {one}  {cells}", flush=True)
            rows.append({"kind": "largest", "frontend": frontend, "limit_mib": args.limit_mib, "limit": limit_kind,
                         "layers": {str(pp): n for pp, n in found.items()}})
    headline = []
    for row in rows:
        if row["kind"] == "marginal" and row["model"] == "mlp" and row["pp"] in (2, 4):
            setting = "" if row.get("optimize", "speed") == "speed" else f" ({SETTING_LABEL[row['optimize']]})"
            headline.append({"what": f"{row['frontend']}{setting} deep MLP, memory per rank at pp {row['pp']} / one "
                                     "process (marginal peak, worst rank)", "value": f"{max(row['peak_share']):.2f}x"})
        if row["kind"] == "largest":
            sizes = row["layers"]
            headline.append({"what": f"{row['frontend']}: layers trainable under {row['limit_mib']} MiB per process, "
                                     "one process / pp " + " / pp ".join(k for k in sizes if k != "0"),
                             "value": " / ".join(str(v) for v in sizes.values())})
    path = write_record("bench_memory", rows, settings={"launches": args.launches, "steps": STEPS,
                                                        "microbatches": args.microbatches, "width": WIDTH,
                                                        "layers": LAYERS},
                        tables=[marginal, *([limited] if limited.rows else [])], headline=headline)
    print(f"\nrecord: {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
    main()
