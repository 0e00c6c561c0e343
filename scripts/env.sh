#!/usr/bin/env bash
# Creates (or refreshes) the project venv in .venv with the pinned versions, and installs smp editable.
# Sourced by scripts/test.sh and scripts/demo.sh; safe to run again (a stamp skips work when nothing changed).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.smp-stamp"
want="$(cat "$root/requirements/dev.txt" "$root/setup.py" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[smp] creating $venv"
  "$py" -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[smp] installing pinned dependencies (requirements/dev.txt)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/requirements/dev.txt"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
