#!/usr/bin/env bash
# Correctness and timing of every kernel on a GPU, in under 5 minutes: each module has its
# own time limit (one slow part cannot starve the next) and no module may run past the
# script's budget (BUDGET seconds, 280 by default; one left with < 15 s is skipped).
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
# Module limits from the first H200 runs (flash_ffn 25-148 s before its warp-specialized
# bodies, frac 45, pack3d 51-98, tune 44), in run order; correctness comes before timing inside each module.
# gpu_pack3d_gemm_tail: the Pack3D XLA-path diagnostic (issue 34), ~45 s on a GPU.
# gpu_cross_chip: every impl of every op against the float64 CPU reference (issue 34).
declare -A LIMIT=([gpu_flash_ffn]=150 [gpu_frac]=70 [gpu_pack3d]=90 [gpu_pack3d_gemm_tail]=70 [gpu_cross_chip]=60 [gpu_pack3d_xla]=40 [gpu_tune_flash_ffn]=45)
BUDGET=${BUDGET:-280}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  "$PY" -c "import sys, jax, jaxlib, flax; print('python', sys.version.split()[0], 'jax',
jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, jax.devices())" || exit 1
  echo "ptxas: $(command -v ptxas || echo none)"
  status=0
  modules=("$@")
  # FlashFFN first (its one-warpgroup and warp-specialized bodies side by side, issue 32),
  # then the open Pack3D diagnostic, every impl against the float64 CPU reference, the other
  # kernels' correctness and timing, tuning last
  [ ${#modules[@]} -gt 0 ] || modules=(gpu_flash_ffn gpu_pack3d_gemm_tail gpu_cross_chip
                                       gpu_frac gpu_pack3d gpu_pack3d_xla gpu_tune_flash_ffn)
  for name in "${modules[@]}"; do
    limit=${LIMIT[$name]:-60}
    left=$((BUDGET - SECONDS))
    (( left < limit )) && limit=$left
    if (( limit < 15 )); then echo "SKIPPED: $name (${left} s of the ${BUDGET} s budget left)"; status=1; continue; fi
    echo "== $name (limit $limit s)"
    start=$SECONDS
    timeout "$limit" "$PY" -m "benchmarks.$name" || { echo "FAILED: $name"; status=1; }
    echo "   $name: $((SECONDS - start)) s"
  done
  exit $status
} 2>&1 | tee "$LOG"
