"""GPU check: Transformer Engine TP linears against the torch fallback, and NCCL under smp (one GPU).

Not a pytest module (pytest collects ``test_*.py`` only); run it on a CUDA machine::

    python tests/gpu/check_te.py          # or: bash tests/gpu/run.sh

Checks, each a row of the PASS/FAIL/SKIP table printed at the end (exit status 1 on any FAIL):

(a) tp=1, fp32 and bf16: `ColumnParallelLinear` -> `RowParallelLinear` (fallback) against the same
    layers as ``te.Linear(parallel_mode="column"/"row")`` holding copies of the weights: output,
    input gradient and every parameter gradient; also the TE modules' state-dict keys.
(b) tp=2, two processes sharing the GPU: NCCL if it accepts two ranks on one device, else gloo on
    CUDA tensors; fallback against a dense single-process reference, and TE against the fallback.
(c) smp runtime: ``smp.init({"ddp": True, "tensor_parallel_degree": 2})`` on 2 processes (NCCL for
    CUDA tensors), an allreduce and a TP layer pair against the dense reference. NCCL normally
    refuses two ranks on one GPU ("Duplicate GPU detected"); that is reported as SKIP, not FAIL.

Without Transformer Engine it prints "TE not installed: fallback-only checks" and runs the rest.
Tolerance, per compared tensor: ``max|a - b| <= atol + rtol * max|reference|`` with fp32 atol 1e-5,
rtol 1e-3 (room for TF32 GEMMs) and bf16 atol 1e-2, rtol 1.6e-2 (two bf16 ulps).

``SMP_CHECK_DEVICE=cpu`` runs the same code on CPU/gloo with the TE rows skipped: a dry run of this
script's own logic on a machine without a GPU; it checks nothing about CUDA or TE.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

IN, HIDDEN, BATCH = 64, 128, 16
TOLERANCE = {torch.float32: (1e-5, 1e-3), torch.bfloat16: (1e-2, 1.6e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
Row = tuple[str, str, str]  # check, PASS/FAIL/SKIP, detail


def _device() -> str:
    return os.environ.get("SMP_CHECK_DEVICE", "cuda")


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> Row:
    atol, rtol = TOLERANCE[dtype]
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    if got.shape != ref.shape:
        return name, "FAIL", f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
    diff = float((got - ref).abs().max())
    tol = atol + rtol * float(ref.abs().max())
    return name, "PASS" if diff <= tol else "FAIL", f"max|diff| {diff:.3e} <= tol {tol:.3e}"


def _dense_pair(dtype: torch.dtype) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    return nn.Linear(IN, HIDDEN).to(dtype), nn.Linear(HIDDEN, IN).to(dtype)


def _run(first: nn.Module, second: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = second(first(x))
    y.backward(gy)
    out = {"output": y.detach(), "input grad": x.grad}
    for tag, m in (("col", first), ("row", second)):
        out.update({f"{tag}.{n} grad": p.grad for n, p in m.named_parameters()})
    return out


def _inputs(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, IN, generator=g).to(device, dtype)
    return x, torch.randn(BATCH, IN, generator=g).to(device, dtype)


def _compare_runs(prefix: str, got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> list[Row]:
    return [_compare(f"{prefix} {k}", got[k], ref[k], dtype) for k in ref]


def check_tp1(te_ok: bool) -> list[Row]:
    """(a): fallback vs TE with the same weights, no process group."""
    from smp.torch.nn import te_backend
    from smp.torch.nn.linear import ColumnParallelLinear, RowParallelLinear

    rows: list[Row] = []
    device = _device()
    for tag, dtype in DTYPES.items():
        if not te_ok:
            rows.append((f"tp1 {tag} TE vs fallback", "SKIP", "TE not installed"))
            continue
        dense1, dense2 = _dense_pair(dtype)
        col = ColumnParallelLinear.from_linear(dense1).to(device)
        row = RowParallelLinear.from_linear(dense2).to(device)
        te_col, te_row = te_backend.maybe_te(col), te_backend.maybe_te(row)
        kinds = f"{type(te_col).__name__}/{type(te_row).__name__}"
        if te_col is col or te_row is row:
            rows.append((f"tp1 {tag} TE selected", "FAIL", te_backend.select_backend(device).reason))
            continue
        rows.append((f"tp1 {tag} TE selected", "PASS", kinds))
        keys = (sorted(te_col.state_dict()), sorted(te_row.state_dict()))
        want = (sorted(col.state_dict()), sorted(row.state_dict()))
        rows.append((f"tp1 {tag} TE state-dict keys", "PASS" if keys == want else "FAIL", f"{keys} vs {want}"))
        x, gy = _inputs(dtype, device)
        rows += _compare_runs(f"tp1 {tag} TE vs fallback", _run(te_col, te_row, x, gy), _run(col, row, x, gy),
                              dtype)
        # gather_output / input_is_parallel=False go through the hooks.
        gcol = ColumnParallelLinear.from_linear(dense1, gather_output=True).to(device)
        srow = RowParallelLinear.from_linear(dense2, input_is_parallel=False).to(device)
        with torch.no_grad():
            rows.append(_compare(f"tp1 {tag} TE hooks (gather/scatter) output",
                                 te_backend.te_linear_from(srow)(te_backend.te_linear_from(gcol)(x)),
                                 srow(gcol(x)), dtype))
    return rows


def _tp2_body(backend: str, te_wanted: bool, via_smp: bool) -> list[Row]:
    """One rank of (b) or (c): returns this rank's rows."""
    import torch.distributed as dist

    device = _device()
    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU
    if via_smp:
        import smp.torch as smp

        smp.init({"ddp": True, "tensor_parallel_degree": 2})
        group = None  # the layers resolve smp's TP group
        t = torch.full((4,), float(rank + 1), device=device)
        dist.all_reduce(t)
        if device == "cuda":
            torch.cuda.synchronize()
        rows = [(f"smp allreduce (world, {device} tensor)", "PASS" if float(t[0]) == 3.0 else "FAIL",
                 f"backend {dist.get_backend()}, sum {float(t[0])}")]
    else:
        dist.init_process_group(backend, init_method="file://" + os.environ["SMP_RENDEZVOUS_FILE"],
                                rank=rank, world_size=2)
        group = dist.group.WORLD
        rows = []
    from smp.torch.nn import te_backend
    from smp.torch.nn.linear import ColumnParallelLinear, RowParallelLinear

    where = "smp" if via_smp else f"tp2 {backend}"
    for tag, dtype in DTYPES.items():
        dense1, dense2 = _dense_pair(dtype)
        col = ColumnParallelLinear.from_linear(dense1, process_group=group).to(device)
        row = RowParallelLinear.from_linear(dense2, process_group=group).to(device)
        d1, d2 = dense1.to(device), dense2.to(device)
        x, gy = _inputs(dtype, device)
        ref = _run(d1, d2, x, gy)
        got = _run(col, row, x, gy)
        # This rank's slices of the dense gradients.
        half = HIDDEN // 2
        sl = slice(rank * half, (rank + 1) * half)
        dense_ref = {"output": ref["output"], "input grad": ref["input grad"],
                     "col.weight grad": ref["col.weight grad"][sl], "col.bias grad": ref["col.bias grad"][sl],
                     "row.weight grad": ref["row.weight grad"][:, sl], "row.bias grad": ref["row.bias grad"]}
        rows += _compare_runs(f"{where} {tag} fallback vs dense", got, dense_ref, dtype)
        if te_wanted:
            te_col, te_row = te_backend.maybe_te(col), te_backend.maybe_te(row)
            if te_col is col or te_row is row:
                rows.append((f"{where} {tag} TE selected", "FAIL", te_backend.select_backend(device).reason))
            else:
                rows += _compare_runs(f"{where} {tag} TE vs fallback", _run(te_col, te_row, x, gy), got, dtype)
    return [(f"rank {rank} {name}", status, detail) for name, status, detail in rows]


def _spawn(body_args: tuple[Any, ...], timeout: float) -> tuple[list[Row] | None, str]:
    """Run `_tp2_body` on 2 ranks; (rows, "") or (None, error text)."""
    from tests.helpers.spawn import RankFailure, run_ranks

    try:
        results = run_ranks(_tp2_body, 2, args=body_args, timeout=timeout, expect_failure=True)
    except RankFailure as e:
        return None, str(e)
    errors = [str(v) for status, v in results if status != "ok"]
    if errors:
        return None, "\n".join(errors)
    return [row for _, rank_rows in results for row in rank_rows], ""


def _nccl_refused(text: str) -> bool:
    return any(s in text for s in ("Duplicate GPU", "ncclInvalidUsage", "invalid usage"))


def check_tp2(te_ok: bool) -> list[Row]:
    """(b): NCCL first, gloo on CUDA tensors if NCCL refuses two ranks on one GPU."""
    backends = ["nccl", "gloo"] if _device() == "cuda" else ["gloo"]
    rows: list[Row] = []
    for backend in backends:
        got, error = _spawn((backend, te_ok, False), timeout=120)
        if got is not None:
            return rows + got + ([] if te_ok else [("tp2 TE vs fallback", "SKIP", "TE not installed")])
        last = error.strip().splitlines()[-1] if error.strip() else "no output"
        status = "SKIP" if backend == "nccl" and _nccl_refused(error) else "FAIL"
        rows.append((f"tp2 {backend}", status, last[:160]))
        if status == "FAIL":  # after an NCCL failure gloo still runs, but the FAIL row stays
            print(f"--- tp2 {backend} failed:\n{error}", file=sys.stderr)
    return rows


def check_smp_runtime() -> list[Row]:
    """(c): smp.init with ddp and tp=2 on 2 processes."""
    got, error = _spawn(("smp", False, True), timeout=120)
    if got is not None:
        return got
    last = error.strip().splitlines()[-1] if error.strip() else "no output"
    if _nccl_refused(error):
        return [("smp.init ddp tp=2 (NCCL, 2 ranks on 1 GPU)", "SKIP", f"NCCL refuses: {last[:140]}")]
    print(f"--- smp runtime check failed:\n{error}", file=sys.stderr)
    return [("smp.init ddp tp=2", "FAIL", last[:160])]


def main() -> int:
    start = time.monotonic()
    device = _device()
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL: CUDA is not available (set SMP_CHECK_DEVICE=cpu for a CPU dry run of this script)")
        return 1
    from smp.torch.nn import te_backend

    te_ok = device == "cuda" and te_backend.te_module() is not None
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else " (dry run: nothing about CUDA/TE)"))
    if te_ok:
        import transformer_engine

        print(f"transformer_engine {getattr(transformer_engine, '__version__', '?')}")
    else:
        print("TE not installed: fallback-only checks"
              + (f" ({te_backend.select_backend(device).reason})" if device == "cuda" else ""))
    rows: list[Row] = []
    for check in (lambda: check_tp1(te_ok), lambda: check_tp2(te_ok), check_smp_runtime):
        try:
            rows += check()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            traceback.print_exc()
            rows.append((getattr(check, "__name__", "check"), "FAIL", f"{type(e).__name__}: {e}"[:160]))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check'.ljust(width)}  status  detail")
    for name, status, detail in rows:
        print(f"{name.ljust(width)}  {status.ljust(6)}  {detail}")
    failed = sum(r[1] == "FAIL" for r in rows)
    counts = {s: sum(r[1] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {time.monotonic() - start:.0f} s: "
          + ("FAIL" if failed else "PASS"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
