"""FlashFFN block sizes on the GPU at hand: fwd+bwd time of a few candidate tiles per kernel
body at the paper's shape (B = 4, L = 16384, bfloat16), the tuned entry first.

Run last by benchmarks/gpu_check.sh (a candidate that does not compile, or spills, is
reported and skipped); the best row per body is a candidate for `TUNED` in
pallas_kernels/flash_ffn/blocks.py once `make compile-check` passes it for the chip.
  python -m benchmarks.gpu_tune_flash_ffn
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import wall_seconds
from benchmarks.gpu_flash_ffn import ON_GPU, fwd_and_step, gpu_backends, op_inputs
from neurips26_jax.pallas_kernels import flash_ffn as kernel
from neurips26_jax.pallas_kernels.flash_ffn.blocks import BlockSizes

# (block_q, block_inter, block_q_dkv, num_warps, num_warps_dkv, num_stages, compute_wgs);
# compute_wgs=2: the warp-specialized kernels (Hopper).
CANDIDATES = {
    "triton": [(64, 64, 64, 4, 8, 2, 1), (128, 32, 64, 4, 8, 2, 1), (64, 32, 128, 4, 8, 3, 1),
               (128, 64, 64, 8, 8, 2, 1)],
    "mosaic_gpu": [(64, 64, 64, 4, 4, 2, 1), (128, 32, 64, 4, 4, 2, 1), (64, 64, 64, 4, 4, 3, 1),
                   (64, 32, 32, 4, 4, 2, 2), (64, 64, 32, 4, 4, 2, 2),
                   (64, 64, 32, 4, 4, 3, 2)],
}
FIELDS = ("block_q", "block_inter", "block_q_dkv", "num_warps", "num_warps_dkv", "num_stages",
          "compute_wgs")


def main() -> int:
  if not ON_GPU:
    print("no GPU: nothing to tune")
    return 0
  args = op_inputs(4, 16384, jnp.bfloat16, seed=2)
  for backend in gpu_backends():
    tuned = dataclasses.astuple(BlockSizes.for_backend(backend, jnp.bfloat16))
    results = []
    for cand in [tuned] + [c for c in CANDIDATES[backend] if c != tuned]:
      blocks = dict(zip(FIELDS, cand))
      fwd, step = fwd_and_step(functools.partial(kernel.mhffn, backend=backend,
                                                 interpret=False, **blocks))
      label = f"{backend} {'tuned ' if cand == tuned else ''}{blocks}"
      try:
        fwd_s, step_s = wall_seconds(fwd, *args, repeats=5), wall_seconds(step, *args, repeats=5)
      except Exception as e:  # noqa: BLE001  (a candidate that fails is reported, not fatal)
        print(f"  {label}: failed: {str(e).splitlines()[0][:160]}", flush=True)
        continue
      results.append((step_s, label))
      print(f"  {label}: fwd {fwd_s * 1e3:.2f} ms, fwd+bwd {step_s * 1e3:.2f} ms", flush=True)
    if results:
      best = min(results)
      print(f"  best {backend}: {best[1]} fwd+bwd {best[0] * 1e3:.2f} ms "
            f"({results[0][0] / best[0]:.2f}x the tuned entry)", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
