#!/usr/bin/env bash
# Build the API reference (pdoc, from the docstrings of smp.torch and smp.tensorflow) into build/api/;
# fails on a public name without a docstring, a pdoc warning or a broken link in README.md / docs/.
#   bash scripts/docs.sh            then open build/api/index.html
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"
exec python scripts/api_docs.py "$@"
