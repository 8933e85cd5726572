#!/usr/bin/env bash
# Correctness and timing of every kernel on a GPU, in well under 5 minutes.
# Runs each benchmarks/gpu_*.py module (one per op): the compiled Triton kernel against
# its reference, then its time against the XLA baseline. Uses the machine's own python3
# with JAX (the device image has jax with CUDA; nothing is installed).
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1
status=0
for module in benchmarks/gpu_*.py; do
  name=$(basename "$module" .py)
  echo "== $name"
  timeout 120 "$PY" -m "benchmarks.$name" || { echo "FAILED: $name"; status=1; }
done
exit $status
