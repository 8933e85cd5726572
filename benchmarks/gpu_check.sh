#!/usr/bin/env bash
# Correctness and timing of every kernel on a GPU, in well under 5 minutes.
# Runs each benchmarks/gpu_*.py module (one per op); each compares the compiled Triton
# kernel with its reference and times it against the XLA baseline.
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if ! "$PY" -c "import jax" 2>/dev/null; then
  "$PY" -m pip install --quiet "jax[cuda12]==0.10.2" -e . || exit 1
fi
"$PY" -c "import jax; print('devices:', jax.devices())"
status=0
for module in benchmarks/gpu_*.py; do
  name=$(basename "$module" .py)
  echo "== $name"
  timeout 120 "$PY" -m "benchmarks.$name" || { echo "FAILED: $name"; status=1; }
done
exit $status
