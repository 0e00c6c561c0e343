#!/usr/bin/env bash
# GPU check of the Transformer Engine backend (tests/gpu/check_te.py); run from anywhere.
#
#   bash tests/gpu/run.sh              # uses $PYTHON, else the repo's .venv, else python3
#   SMP_TE_INSTALL=0 bash tests/gpu/run.sh   # do not try to pip-install Transformer Engine
#
# Tries `pip install transformer_engine[pytorch]` when TE does not import; offline (or without the
# CUDA headers it builds against) that fails, and the check then runs fallback-only.
set -u
cd "$(dirname "$0")/../.."

if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi
echo "python: $PY"
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "FAIL: $PY cannot import torch; set PYTHON to an interpreter with a CUDA build of torch"
    exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

# smp itself: an editable install without dependencies (offline-safe: no build isolation).
if ! "$PY" -c "import smp.torch" 2>/dev/null; then
    echo "installing smp (editable, --no-deps)"
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
        || { echo "FAIL: could not install smp"; exit 1; }
fi

if ! "$PY" -c "import transformer_engine.pytorch" 2>/dev/null; then
    if [ "${SMP_TE_INSTALL:-1}" != "0" ]; then
        echo "transformer_engine does not import; trying pip install transformer_engine[pytorch] (may fail offline)"
        timeout 600 "$PY" -m pip install --quiet --no-build-isolation "transformer_engine[pytorch]" \
            || echo "pip install transformer_engine[pytorch] failed: fallback-only checks"
    fi
fi

exec "$PY" tests/gpu/check_te.py "$@"
