#!/usr/bin/env bash
# README command 1: set up the pinned venv and run the main demo: a small GPT trained pipelined over
# 2 CPU ranks (progress bar, partition report, measured timeline, loss curve in demo-output/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/env.sh"
cd "$root"
export OMP_NUM_THREADS=1
torchrun --nproc-per-node 2 examples/train_gpt.py --out demo-output "$@" 2> >(grep -v -e "^W1" -e "^\*\*\*\*" -e "OMP_NUM_THREADS" >&2)
