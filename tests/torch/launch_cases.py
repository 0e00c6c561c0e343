"""Run several multi-rank cases of one world size in one launch, ``smp.reset()`` between them.

Usage::

    from tests.torch.launch_cases import run_cases

    CASES = [("tp2-prescaled", _train, {"prescaled": True}),   # (name, rank body, keyword arguments)
             ("tp2-per-rank", _train, {"prescaled": False})]
    for name, per_rank in run_cases(2, CASES, timeout=600).items():
        with naming(name):
            check(per_rank)

On 2 cores, starting the ranks (each imports torch and transformers) costs more than training the
tiny test models, so one launch per world size instead of one per case saves most of a file's time.
Each rank body calls ``smp.init`` itself; a case that raises on a rank says which case it was (a
note on the exception, in the traceback ``run_ranks`` re-raises), and `naming` does the same for a
failed check in the test process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from tests.helpers.spawn import run_ranks

Case = tuple[str, Callable[..., Any], Mapping[str, Any]]  # (name, module-level rank body, its kwargs)


def _run_each(cases: Sequence[Case]) -> list[Any]:
    """On one rank: each case's body in turn, ``smp.reset()`` after each; the results in order."""
    import smp.torch as smp

    results = []
    for name, body, kwargs in cases:
        try:
            results.append(body(**kwargs))
        except BaseException as e:
            e.add_note(f"(in case {name!r})")
            raise
        smp.reset()
    return results


def run_cases(world: int, cases: Sequence[Case], *, timeout: float) -> dict[str, list[Any]]:
    """Every case's results by rank, by case name, from one launch of ``world`` ranks.

    ``timeout`` covers the whole launch (all cases together).
    """
    names = [name for name, _, _ in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique, got {names}")
    per_rank = run_ranks(_run_each, world, args=(list(cases),), timeout=timeout)
    assert all(len(results) == len(cases) for results in per_rank), [len(r) for r in per_rank]
    return {name: [results[i] for results in per_rank] for i, name in enumerate(names)}


@contextlib.contextmanager
def naming(name: str) -> Iterator[None]:
    """A failed assertion inside says which case it was checking."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"case {name!r}: {e}") from e
