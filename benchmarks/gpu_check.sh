#!/usr/bin/env bash
# Correctness and timing of every kernel on a GPU, in under 5 minutes (each module has its
# own time limit, so one slow part cannot starve the others).
# Runs each benchmarks/gpu_*.py module: every compiled kernel body (Triton; Mosaic GPU on
# Hopper) against its float32 reference, then its time beside the XLA baselines; last, a
# small block-size sweep. Uses the machine's own python3 with JAX (the device image has
# jax with CUDA; nothing is installed). With $OUT set, the log is also written there.
#   bash benchmarks/gpu_check.sh                 # every module
#   bash benchmarks/gpu_check.sh gpu_pack3d      # some of them
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Mosaic GPU runs ptxas from PATH.
for dir in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
  [ -x "$dir/ptxas" ] && export PATH="$PATH:$dir" && break
done
PY=${PY:-python3}
# Checks run in subprocesses beside the parent: no process takes 75% of the memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=${OUT:+$OUT/gpu_check.log}
LOG=${LOG:-/dev/null}
declare -A LIMIT=([gpu_flash_ffn]=200 [gpu_pack3d]=180 [gpu_pack3d_xla]=60 [gpu_frac]=90 [gpu_tune_flash_ffn]=80)
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PY" -c "import sys, jax, jaxlib, flax; print('python', sys.version.split()[0], 'jax',
jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())" || exit 1
  echo "ptxas: $(command -v ptxas || echo none)"
  status=0
  modules=("$@")
  [ ${#modules[@]} -gt 0 ] || modules=($(cd benchmarks && ls gpu_*.py | sed 's/\.py$//'))
  for name in "${modules[@]}"; do
    echo "== $name (limit ${LIMIT[$name]:-90} s)"
    start=$SECONDS
    timeout "${LIMIT[$name]:-90}" "$PY" -m "benchmarks.$name" || { echo "FAILED: $name"; status=1; }
    echo "   $name: $((SECONDS - start)) s"
  done
  exit $status
} 2>&1 | tee "$LOG"
