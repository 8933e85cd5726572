"""FlashFFN on a GPU: compiled Triton kernel vs reference, and fwd+bwd time vs SwiGLU.

Run by benchmarks/gpu_check.sh; prints one line per check, exits non-zero on a mismatch.
  python -m benchmarks.gpu_flash_ffn
On a machine without a GPU the kernel runs interpreted on a short sequence (a smoke test).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import report_errors, wall_seconds
from jaxops import flash_ffn as ops
from models import FlashFFN, SwiGLU
from pallas_kernels import flash_ffn as kernel

D, HEADS, EXPERTS, D_E, D_FF_SWIGLU = 1024, 8, 11, 256, 2752
ON_GPU = jax.default_backend() == "gpu"


def check(dtype, length, tol) -> bool:
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (1, length, HEADS, D // HEADS)).astype(dtype)
  r = jax.nn.softmax(jax.random.normal(ks[1], (1, length, HEADS, EXPERTS)))
  k, u, v = (0.05 * jax.random.normal(kk, (HEADS, EXPERTS, D_E, D // HEADS)).astype(dtype)
             for kk in ks[2:])
  loss = lambda op, *a: jnp.sum(jnp.sin(op(*a).astype(jnp.float32)))
  grads = lambda op: jax.jit(jax.grad(functools.partial(loss, op), argnums=range(5)))
  fast = grads(functools.partial(kernel.mhffn, interpret=None if ON_GPU else True))(q, r, k, u, v)
  ref = grads(ops.mhffn_reference)(*(a.astype(jnp.float32) for a in (q, r, k, u, v)))
  return report_errors(f"{jnp.dtype(dtype).name} L={length}", [f"d{n}" for n in "qrkuv"],
                       fast, ref, tol)


def timing(length: int, dtype) -> None:
  x = jax.random.normal(jax.random.key(1), (1, length, D), dtype)
  layers = {
      "SwiGLU": SwiGLU(D, D_FF_SWIGLU, dtype=dtype, rngs=nnx.Rngs(0)),
      "FlashFFN Triton": FlashFFN(D, HEADS, EXPERTS, D_E, impl="pallas", interpret=False,
                                  dtype=dtype, rngs=nnx.Rngs(0)),
      "FlashFFN XLA": FlashFFN(D, HEADS, EXPERTS, D_E, impl="xla", dtype=dtype,
                               rngs=nnx.Rngs(0)),
  }
  times = {}
  for name, layer in layers.items():
    graphdef, params = nnx.split(layer)
    fwd = lambda p, x: nnx.merge(graphdef, p)(x)
    step = jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32) ** 2), argnums=(0, 1))
    times[name] = (wall_seconds(fwd, params, x, repeats=10),
                   wall_seconds(step, params, x, repeats=10))
  for name, (fwd_s, step_s) in times.items():
    print(f"  L={length} {jnp.dtype(dtype).name} {name:16s} fwd {fwd_s * 1e3:7.2f} ms  "
          f"fwd+bwd {step_s * 1e3:7.2f} ms  (SwiGLU/this fwd "
          f"{times['SwiGLU'][0] / fwd_s:.2f}x, fwd+bwd {times['SwiGLU'][1] / step_s:.2f}x)")


def main() -> int:
  print(f"FlashFFN d={D} H={HEADS} E={EXPERTS} d_e={D_E}, devices: {jax.devices()}")
  if not ON_GPU:  # smoke test of this script: interpreted kernel, short sequence
    return 0 if check(jnp.float32, 40, 1e-4) else 1
  # float32 tiles go through tl.dot in TF32 (as XLA does on GPU by default): 1e-2.
  ok = check(jnp.float32, 1000, 1e-2) & check(jnp.bfloat16, 4096, 5e-2)
  for length in (4096, 16384):
    timing(length, jnp.bfloat16)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
