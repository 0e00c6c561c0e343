"""The `smp` command line: dispatches subcommands (`smp plan`, `smp config`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

USAGE = """usage: smp <command> [options]

commands:
  plan      build, validate, simulate and draw a pipeline plan (see `smp plan --help`)
  config    print the table of configuration keys (`smp config --markdown`)
"""


# Subcommand variants that need a framework live in a frontend. The core names them here by
# import path ("module:function") and resolves the path with importlib only when the flag is given,
# so `smp` never imports `smp.torch` (issue 10, item 4; tests/smp/test_import_graph.py). A frontend
# (or a plugin) adds a variant with `register_plan_provider`.
PLAN_PROVIDERS: dict[str, str] = {
    # Building a Hugging Face model on the meta device needs torch and transformers.
    "--hf-config": "smp.torch.partitioning.hf_plan:main",
}


def register_plan_provider(flag: str, target: str) -> None:
    """Route ``smp plan <flag> ...`` to ``target`` ("package.module:function", imported lazily).

    Example:
        >>> register_plan_provider("--hf-config", "smp.torch.partitioning.hf_plan:main")
    """
    PLAN_PROVIDERS[flag] = target


def resolve_provider(target: str) -> Callable[[Sequence[str]], int]:
    """Import ``"package.module:function"`` and return the function."""
    module_name, _, attr = target.partition(":")
    func: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module_name), attr)
    return func


def _plan(argv: Sequence[str]) -> int:
    for flag, target in PLAN_PROVIDERS.items():
        if flag in argv:
            return int(resolve_provider(target)(argv))
    from smp.pipeline.cli import main as plan_main

    return plan_main(argv)


def _config(argv: Sequence[str]) -> int:
    from smp.config.docs import main as config_main

    return config_main(argv)


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"plan": _plan, "config": _config}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"smp: unknown command {args[0]!r}; valid commands: {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
