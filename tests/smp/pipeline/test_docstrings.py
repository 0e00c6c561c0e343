"""The examples in the docstrings run and print what they claim."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import smp.pipeline
from smp.pipeline import format_grid

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(smp.pipeline.__path__, prefix="smp.pipeline.")
) + ["smp.pipeline"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    module = importlib.import_module(name)
    failed, _ = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert failed == 0


def test_every_module_opens_with_a_docstring() -> None:
    for name in MODULES:
        doc = importlib.import_module(name).__doc__
        assert doc and doc.strip(), name


SLOT = {"forward": 1.0, "backward": 1.0, "backward_weight": 0.5}
DRAWN_EXAMPLES = [
    # (module:function holding the example, schedule, ranks, microbatches, build kwargs, unit slots?)
    ("smp.pipeline.schedules.smp_v1:build_interleaved", "interleaved", 3, 8, {}, True),
    ("smp.pipeline.schedules.smp_v1:build_simple", "simple", 2, 4, {"active_microbatches": 2}, True),
    ("smp.pipeline.schedules.smp_v1:build_gpipe", "gpipe", 2, 3, {}, True),
    ("smp.pipeline.schedules.smp_v1:build_only_forward", "_only_forward", 3, 5, {}, True),
    ("smp.pipeline.schedules.one_f_one_b:build_1f1b", "1f1b", 4, 6, {}, False),
    ("smp.pipeline.schedules.zero_bubble:build_zb_h1", "zb_h1", 3, 4, {}, False),
    ("smp.pipeline.render_ascii:render_ascii", "1f1b", 2, 3, {}, False),
]


@pytest.mark.parametrize(("where", "name", "p", "m", "kwargs", "slots"), DRAWN_EXAMPLES)
def test_drawn_examples_are_what_the_code_draws(
    where: str, name: str, p: int, m: int, kwargs: dict[str, int], slots: bool
) -> None:
    from smp.pipeline import Costs, build_plan, render_ascii, simulate

    module, _, func = where.partition(":")
    holder = importlib.import_module(module)
    doc = (getattr(holder, func).__doc__ or "") + (holder.__doc__ or "")
    costs = Costs(**SLOT) if slots else Costs()
    drawing = render_ascii(simulate(build_plan(name, p, m, **kwargs), costs).timeline)  # type: ignore[arg-type]
    body = [line.strip() for line in doc.splitlines()]
    for line in drawing.splitlines():
        assert line.strip() in body, f"{where}: docstring lacks {line!r}"


GRID_EXAMPLES = [
    ("smp.pipeline.schedules.one_f_one_b:build_interleaved_1f1b", "interleaved_1f1b", 2, 4, {"virtual_stages": 2}),
    ("smp.pipeline.schedules.zero_bubble:build_zb_v", "zb_v", 2, 3, {}),
    ("smp.pipeline.plan:Plan", "1f1b", 2, 2, {}),
]


@pytest.mark.parametrize(("where", "name", "p", "m", "kwargs"), GRID_EXAMPLES)
def test_grid_examples_are_what_the_code_prints(where: str, name: str, p: int, m: int, kwargs: dict[str, int]) -> None:
    from smp.pipeline import build_plan

    module, _, func = where.partition(":")
    holder = importlib.import_module(module)
    doc = (getattr(holder, func).__doc__ or "") + (holder.__doc__ or "")
    body = [line.strip() for line in doc.splitlines()]
    for line in format_grid(build_plan(name, p, m, **kwargs)).splitlines()[1:]:  # type: ignore[arg-type]
        assert line.strip() in body, f"{where}: docstring lacks {line!r}"
