"""Pack3D's jnp reference and XLA path on a GPU against the CPU, with XLA's Triton GEMM
fusions switched off.

On an H200 (jax 0.11.2) both disagreed with the same code on the CPU when far cubes exist
(0.21 and 0.72 relative max) while the compiled Triton kernel matched the CPU reference; the
GPU program's HLO has Triton GEMM fusions with split-K over a padded contraction. If the
differences below are ~1e-6, those fusions are the cause (XLA_FLAGS must be set before jax
starts, hence this separate module). Run by benchmarks/gpu_check.sh:
  python -m benchmarks.gpu_pack3d_xla
"""

from __future__ import annotations

import os
import sys

FLAG = "--xla_gpu_enable_triton_gemm=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402

from benchmarks import gpu_pack3d  # noqa: E402


def main() -> int:
  print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}, devices: {jax.devices()}")
  if not gpu_pack3d.ON_GPU:
    print("  no GPU: nothing to compare")
    return 0
  gpu_pack3d.cpu_vs_gpu(jnp.float32, gpu_pack3d.CASES["two odd fields"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
