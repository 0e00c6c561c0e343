"""smp.torch.utils.rmsg: SMP v1's rank prefix on log messages."""

from __future__ import annotations

from tests.helpers.spawn import run_ranks


def test_rmsg_before_and_after_init() -> None:
    import smp.torch as smp
    from smp.torch.utils import rmsg

    assert rmsg("loading") == "[?] loading"  # before smp.init: no rank yet, and no exception
    smp.init({})
    assert rmsg("step 3") == "[0] step 3"
    assert smp.utils.rmsg is rmsg


def _prefixes() -> str:
    import smp.torch as smp
    from smp.torch.utils import rmsg

    smp.init({"pipeline_parallel_degree": 1, "ddp": True})
    return rmsg(f"dp_rank {smp.dp_rank()}")


def test_rmsg_names_each_rank() -> None:
    assert run_ranks(_prefixes, 2) == ["[0] dp_rank 0", "[1] dp_rank 1"]
