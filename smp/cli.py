"""The `smp` command line: dispatches subcommands (`smp plan`, `smp config`)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = """usage: smp <command> [options]

commands:
  plan      build, validate, simulate and draw a pipeline plan (see `smp plan --help`)
  config    print the table of configuration keys (`smp config --markdown`)
"""


def _plan(argv: Sequence[str]) -> int:
    if "--hf-config" in argv:
        # Building a Hugging Face model on the meta device needs torch and transformers;
        # that part lives in the torch frontend and is imported only here.
        from smp.torch.hf_plan import main as hf_plan_main

        return int(hf_plan_main(argv))
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
