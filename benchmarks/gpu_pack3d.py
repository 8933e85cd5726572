"""Pack3D on a GPU: compiled Triton kernel vs reference, and fwd+bwd time vs dense attention.

Run by benchmarks/gpu_check.sh; prints one line per check, exits non-zero on a mismatch.
  python -m benchmarks.gpu_pack3d
On a machine without a GPU the kernel runs interpreted and nothing is timed (a smoke test).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import report_errors, wall_seconds
from jaxops import pack3d as ops
from jaxops import packing
from pallas_kernels import pack3d_attention as kernel

HEADS, HEAD_DIM = 2, 48
ON_GPU = jax.default_backend() == "gpu"


def packed(shapes, layout="hilbert"):
  """coords [1, N, 3], field_ids [1, N] for fields of `shapes` packed along `layout`."""
  _, coords, field_ids = packing.pack_fields([np.zeros(s + (1,)) for s in shapes])
  perm, _ = packing.layout_permutation(coords, field_ids, layout)
  return coords[perm][None], field_ids[perm][None]


def qkv(n, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(kk, (1, n, HEADS, HEAD_DIM)).astype(dtype) for kk in keys]


def check(dtype, tol) -> bool:
  """Two fields that are not multiples of the 4^3 cube, in Hilbert order."""
  coords, field_ids = packed([(13, 17, 9), (10, 6, 11)])
  args = qkv(coords.shape[1], dtype)
  loss = lambda op, q, k, v: jnp.sum(jnp.sin(op(q, k, v, coords, field_ids).astype(jnp.float32)))
  grads = lambda op: jax.jit(jax.grad(functools.partial(loss, op), argnums=(0, 1, 2)))
  fast = grads(functools.partial(kernel.pack3d_attention,
                                 interpret=False if ON_GPU else True))(*args)
  ref = grads(ops.pack3d_attention_reference)(*(a.astype(jnp.float32) for a in args))
  return report_errors(f"{jnp.dtype(dtype).name} N={coords.shape[1]}",
                       [f"d{n}" for n in "qkv"], fast, ref, tol)


def timing(shape, dtype) -> None:
  coords, field_ids = packed([shape], layout="raster_zyx")
  n = coords.shape[1]
  args = qkv(n, dtype, seed=1)
  variants = {
      "dense (cuDNN/XLA SDPA)": lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
      "pack3d Triton": lambda q, k, v: kernel.pack3d_attention(q, k, v, coords, field_ids,
                                                               interpret=False),
      "pack3d XLA path": lambda q, k, v: ops.pack3d_attention(q, k, v, coords, field_ids),
  }
  dense = None
  for name, op in variants.items():
    step = jax.grad(lambda q, k, v: jnp.sum(op(q, k, v).astype(jnp.float32) ** 2),
                    argnums=(0, 1, 2))
    try:  # dense may not fit at 65k tokens; say so and go on
      fwd_s, step_s = wall_seconds(op, *args, repeats=5), wall_seconds(step, *args, repeats=5)
    except Exception as e:  # noqa: BLE001  (a benchmark reports, it does not stop)
      print(f"  N={n} {jnp.dtype(dtype).name} {name:22s} not run: {str(e).splitlines()[0][:120]}")
      continue
    dense = (fwd_s, step_s) if name.startswith("dense") else dense
    ratio = (f"dense/this fwd {dense[0] / fwd_s:.2f}x, fwd+bwd {dense[1] / step_s:.2f}x"
             if dense else "dense not run")
    print(f"  N={n} {jnp.dtype(dtype).name} {name:22s} fwd {fwd_s * 1e3:8.2f} ms  "
          f"fwd+bwd {step_s * 1e3:8.2f} ms  ({ratio})")


def main() -> int:
  print(f"Pack3D attention, H={HEADS} D={HEAD_DIM}, devices: {jax.devices()}")
  ok = check(jnp.float32, 2e-3) & check(jnp.bfloat16, 5e-2)
  if not ON_GPU:
    return 0 if ok else 1
  for shape in ((16, 32, 32), (32, 32, 64)):  # 16k and 65k tokens
    timing(shape, jnp.bfloat16)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
