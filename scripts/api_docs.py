"""Build the API reference of ``smp.torch`` and ``smp.tensorflow`` with pdoc, and fail on what would break it.

Checks, before writing anything: every public name (a module's ``__all__``) of both packages has a
docstring; pdoc documents every module without a warning; every relative link in README.md and
docs/*.md points at a file that exists (and, with ``#anchor``, at a heading of that file). The
pages say which SMP v1 module each package replaces: the names are SMP v1's.

    python scripts/api_docs.py build/api        # what `bash scripts/docs.sh` runs
    python scripts/api_docs.py --check          # the checks only (the test suite runs this)
"""

from __future__ import annotations

import argparse
import glob
import importlib
import inspect
import os
import pathlib
import re
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"smp.torch": "smdistributed.modelparallel.torch", "smp.tensorflow": "smdistributed.modelparallel.tensorflow"}
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def undocumented() -> list[str]:
    """Public names of the packages without a docstring."""
    missing = []
    for name in PACKAGES:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)) and not inspect.getdoc(obj):
                missing.append(f"{name}.{attr}")
    return missing


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def broken_links() -> list[str]:
    """Relative links of README.md and docs/*.md that point nowhere."""
    bad = []
    for page in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(page) as f:
            text = f.read()
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            where = os.path.relpath(page, ROOT)
            if not os.path.exists(dest):
                bad.append(f"{where}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                bad.append(f"{where}: {target} (no such heading)")
    return bad


def build(out: str | None) -> list[str]:
    """Render the reference into ``out`` (or nowhere); the warnings pdoc gave."""
    import pdoc
    import pdoc.render

    for name in PACKAGES:  # import first: the frameworks' own import-time warnings are not ours
        importlib.import_module(name)
    pdoc.render.configure(docformat="google", footer_text="smp: the SMP v1 API outside SageMaker")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if out is None:
            for name in PACKAGES:
                pdoc.doc.Module(importlib.import_module(name))
        else:
            pdoc.pdoc(*PACKAGES, output_directory=pathlib.Path(out))
    return [f"{w.category.__name__}: {w.message}" for w in caught if "pdoc" in (w.filename or "")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join(ROOT, "build", "api"))
    p.add_argument("--check", action="store_true", help="run the checks, write nothing")
    args = p.parse_args(argv)
    problems = [f"no docstring: {n}" for n in undocumented()] + broken_links()
    problems += [f"pdoc: {w}" for w in build(None if args.check else args.out)]
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    if not args.check:
        print(f"API reference: {os.path.join(args.out, 'index.html')} "
              f"({', '.join(f'{k} (was {v})' for k, v in PACKAGES.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
