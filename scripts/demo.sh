#!/usr/bin/env bash
# README command 1: set up the pinned venv and run the main demo.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
export OMP_NUM_THREADS=1
echo "== the rank map of a 4-rank launch (pp=2, tp=2, placement spread) =="
torchrun --nproc-per-node 4 examples/rank_map.py --placement spread 2>/dev/null | sort
if python -c "import smp.pipeline" 2>/dev/null; then
  echo; echo "== a 1F1B plan over 4 pipeline ranks, 8 microbatches =="
  smp plan --pp 4 --microbatches 8 --pipeline 1f1b --svg demo-output/plan.svg
fi
