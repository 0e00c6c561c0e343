#!/usr/bin/env bash
# README command 1: set up the pinned venv and run the main demo: a small GPT trained pipelined over
# 2 CPU ranks (progress bar, partition report, measured timeline, loss curve in demo-output/).
#   bash scripts/demo.sh [args...]               torch: examples/train_gpt.py under torchrun
#   bash scripts/demo.sh --tensorflow [args...]  TensorFlow: examples/tensorflow/train_keras.py under
#                                                mpiexec -bind-to core -n 2 (a Keras char transformer; output in demo-output/tf)
# Other arguments pass through to the script (e.g. --steps 20).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tensorflow=0
args=()
for a in "$@"; do
  if [ "$a" = "--tensorflow" ]; then tensorflow=1; else args+=("$a"); fi
done
source "$root/scripts/env.sh"
cd "$root"
export OMP_NUM_THREADS=1
if [ "$tensorflow" = 1 ]; then
  export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}" TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
  # One core per rank: the ranks then overlap microbatches in the scheduler's plan (docs/tensorflow.md).
  exec "$root/.venv/bin/mpiexec" -bind-to core -n 2 "$root/.venv/bin/python" examples/tensorflow/train_keras.py ${args[@]+"${args[@]}"}
fi
torchrun --nproc-per-node 2 examples/train_gpt.py --out demo-output ${args[@]+"${args[@]}"} 2> >(grep -v -e "^W1" -e "^\*\*\*\*" -e "OMP_NUM_THREADS" >&2)
