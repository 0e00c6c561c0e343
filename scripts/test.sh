#!/usr/bin/env bash
# README command 2: set up the pinned venv and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
# In this environment requirements/dev.txt provides every dependency: a test that skips for a
# missing one (transformers, mpiexec, ...) fails the run (tests/helpers/strict_skips.py).
export SMP_TEST_STRICT_SKIPS="${SMP_TEST_STRICT_SKIPS:-1}"
# Exit code 5 (no tests collected) must fail too: pytest already returns non-zero for it.
exec python -m pytest "$@"
