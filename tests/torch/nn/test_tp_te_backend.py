"""When the TP linears run on Transformer Engine and when on the torch fallback (selection only).

Transformer Engine does not install on the CPU machines, so these tests put a stand-in
``transformer_engine`` package on the import path (an empty module, or one whose import raises like
the real wheels do without cuDNN) and patch ``torch.cuda.is_available``. The stand-in exists only to
drive `select_backend` / `swap_to_te`'s choices: no test here runs a TE module or checks TE's
numbers. The numerics (TE vs fallback, tp=1 and tp=2) are checked by ``tests/gpu/check_te.py`` on
a GPU machine.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from smp.torch.nn import te_backend
from smp.torch.nn.linear import ColumnParallelLinear, RowParallelLinear
from torch import nn


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(te_backend.DISABLE_ENV, raising=False)
    te_backend._import_te.cache_clear()
    te_backend._te_linear_class.cache_clear()
    te_backend._logged.clear()
    yield
    te_backend._import_te.cache_clear()
    te_backend._te_linear_class.cache_clear()
    te_backend._logged.clear()


def _fake_te(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``transformer_engine.pytorch`` that imports (selection tests only)."""
    pkg = types.ModuleType("transformer_engine")
    sub = types.ModuleType("transformer_engine.pytorch")
    pkg.pytorch = sub  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", sub)


def _cuda(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def test_te_absent_selects_torch_with_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import raises ImportError
    _cuda(monkeypatch, True)
    choice = te_backend.select_backend("cuda")
    assert choice.name == "torch"
    assert "transformer_engine.pytorch does not import" in choice.reason
    assert "ModuleNotFoundError" in choice.reason or "ImportError" in choice.reason


def test_te_import_runtime_error_selects_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The TE core wheels install without cuDNN and then raise RuntimeError at import (environment.md).
    pkg = tmp_path / "transformer_engine"
    (pkg / "pytorch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pytorch" / "__init__.py").write_text("raise RuntimeError('cudnn shared object not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    _cuda(monkeypatch, True)
    choice = te_backend.select_backend("cuda:0")
    assert choice == ("torch", "transformer_engine.pytorch does not import "
                               "(RuntimeError: cudnn shared object not found)")
    assert te_backend.te_module() is None


def test_te_present_without_cuda_selects_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, False)
    assert te_backend.select_backend(None) == ("torch", "CUDA is not available")
    assert te_backend.select_backend("cuda") == ("torch", "CUDA is not available")


def test_te_present_with_cuda_selects_te_only_for_cuda_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, True)
    assert te_backend.select_backend("cuda") == ("te", "")
    assert te_backend.select_backend(torch.device("cuda", 1)) == ("te", "")
    assert te_backend.select_backend(None) == ("te", "")
    assert te_backend.backend("cuda", enabled=True) == "te"
    assert te_backend.select_backend("cpu") == ("torch", "parameters are on cpu, not CUDA")
    assert te_backend.select_backend("meta").name == "torch"
    assert te_backend.te_module() is sys.modules["transformer_engine.pytorch"]


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_forced_off_by_env(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, True)
    monkeypatch.setenv(te_backend.DISABLE_ENV, value)
    assert te_backend.select_backend("cuda") == ("torch", f"Transformer Engine disabled by SMP_DISABLE_TE={value}")
    assert te_backend._import_te.cache_info().misses == 0  # forced off: TE is not even imported


@pytest.mark.parametrize("value", ["0", "", "false"])
def test_env_values_that_do_not_disable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, True)
    monkeypatch.setenv(te_backend.DISABLE_ENV, value)
    assert te_backend.backend("cuda") == "te"


def test_env_value_neither_on_nor_off_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from smp.errors import LaunchError

    _cuda(monkeypatch, True)
    monkeypatch.setenv(te_backend.DISABLE_ENV, "maybe")
    with pytest.raises(LaunchError, match=r"SMP_DISABLE_TE='maybe' is not understood\. Fix: SMP_DISABLE_TE=1"):
        te_backend.select_backend("cuda")


def test_forced_off_by_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, True)
    assert te_backend.select_backend("cuda", enabled=False) == (
        "torch", "Transformer Engine disabled by the caller (enabled=False)")


def test_reason_logged_once_at_info(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    smp_logger = logging.getLogger("smp")
    smp_logger.addHandler(handler)
    old_level = smp_logger.level
    smp_logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the logger's level cache
    try:
        for _ in range(3):
            te_backend.select_backend("cuda")
        te_backend.select_backend("cpu")
    finally:
        smp_logger.removeHandler(handler)
        smp_logger.setLevel(old_level)
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (logging.INFO, "tensor-parallel linears use the torch fallback: CUDA is not available"),
        (logging.INFO, "tensor-parallel linears use the torch fallback: parameters are on cpu, not CUDA")]


def test_cpu_default_path_unchanged_and_never_imports_te(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    torch.manual_seed(0)
    reference = ColumnParallelLinear(8, 4, gather_output=True)
    torch.manual_seed(0)
    layer = te_backend.column_parallel_linear(8, 4, gather_output=True)
    assert type(layer) is ColumnParallelLinear
    assert torch.equal(layer.weight, reference.weight) and torch.equal(layer.bias, reference.bias)

    dense = nn.Linear(8, 6)
    row = te_backend.row_parallel_linear(8, 6, linear=dense, input_is_parallel=False, device="cpu")
    assert type(row) is RowParallelLinear and torch.equal(row.weight, dense.weight)

    model = nn.Sequential(ColumnParallelLinear(8, 4), RowParallelLinear(4, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert te_backend.swap_to_te(model) == []
    assert [type(m) for m in model] == [ColumnParallelLinear, RowParallelLinear]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert te_backend.maybe_te(model[0]) is model[0]
    assert "transformer_engine" not in sys.modules
    assert te_backend._import_te.cache_info().misses == 0


def test_swap_with_te_present_but_parameters_on_cpu_swaps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_te(monkeypatch)
    _cuda(monkeypatch, True)
    model = nn.Sequential(ColumnParallelLinear(8, 4), RowParallelLinear(4, 8))
    assert te_backend.swap_to_te(model) == []
    assert [type(m) for m in model] == [ColumnParallelLinear, RowParallelLinear]


def test_swap_picks_column_and_row_layers_but_not_tied_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # Which layers are replaced (the builder is a marker here, never a TE module).
    monkeypatch.setattr(te_backend, "select_backend", lambda device=None, enabled=None: te_backend.BackendChoice("te", ""))
    monkeypatch.setattr(te_backend, "te_linear_from", lambda layer: nn.Identity())
    embed = nn.Embedding(10, 8)
    head = ColumnParallelLinear(8, 10)
    head.weight = embed.weight  # tied LM head
    inner = nn.ModuleDict({"up": ColumnParallelLinear(8, 16), "down": RowParallelLinear(16, 8), "act": nn.GELU()})
    model = nn.ModuleDict({"embed": embed, "block": inner, "head": head})
    assert te_backend.swap_to_te(model) == ["block.up", "block.down"]
    assert isinstance(inner["up"], nn.Identity) and isinstance(inner["down"], nn.Identity)
    assert model["head"] is head and isinstance(inner["act"], nn.GELU)


def test_te_linear_from_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match="expected ColumnParallelLinear or RowParallelLinear, found Linear"):
        te_backend.te_linear_from(nn.Linear(2, 2))  # type: ignore[arg-type]
