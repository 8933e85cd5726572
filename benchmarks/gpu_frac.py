"""FRAC on a GPU: each compiled scan kernel body (Triton; Mosaic GPU on Hopper for bf16)
against the reference, and their times beside the XLA path.

Run by benchmarks/gpu_check.sh; prints one line per check, exits non-zero on a mismatch.
  python -m benchmarks.gpu_frac
The Mosaic GPU check runs in its own process (a kernel fault must not take the rest down);
its timing only when that check passed. On a machine without a GPU the kernels run
interpreted at a tiny size (a smoke test).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.common import check_in_subprocess, report_errors, wall_seconds
from neurips26_jax.jaxops import frac as ops
from neurips26_jax.pallas_kernels import dispatch
from neurips26_jax.pallas_kernels import frac_scan as kernel

ON_GPU = jax.default_backend() == "gpu"
HOPPER = (ON_GPU and dispatch.mosaic_gpu_available()
          and (dispatch.compute_capability() or (0,))[0] == 9)
HEADS, P, N, M = 4, 64, 16, 16
ARGNAMES = ("x", "dt", "b", "c", "rates", "weights", "initial_state")


def inputs(length: int, dtype, batch: int = 1):
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (batch, length, HEADS, P)).astype(dtype)
  dt = jax.nn.softplus(jax.random.normal(ks[1], (batch, length, HEADS)))
  b, c = (0.25 * jax.random.normal(ks[2], (2, batch, length, HEADS, N))).astype(dtype)
  rates, weights = ops.soe_modes(jnp.linspace(0.2, 0.9, HEADS), num_modes=M, context=length)
  state = 0.1 * jax.random.normal(ks[4], (batch, HEADS, M, N, P))
  return x, dt, b, c, rates, weights, state


def _loss(op, *args):
  y, state = op(*args)
  return jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(jnp.cos(state))


def check(backend: str, dtype, length: int, tol: float) -> bool:
  """Outputs and all seven gradients of one kernel body against the float32 reference."""
  args = inputs(length, dtype)
  run = lambda op: jax.jit(lambda *a: (op(*a), jax.grad(functools.partial(_loss, op),
                                                        argnums=tuple(range(7)))(*a)))
  fast = run(functools.partial(kernel.frac_scan, backend=backend,
                               interpret=None if ON_GPU else True))(*args)
  ref = run(ops.frac_scan_reference)(*(a.astype(jnp.float32) for a in args))
  names = ("y", "state") + tuple(f"d{n}" for n in ARGNAMES)
  return report_errors(f"{backend} {jnp.dtype(dtype).name} L={length}", names,
                       jax.tree.leaves(fast), jax.tree.leaves(ref), tol)


def timing(length: int, dtype, batch: int, backends, mode_blocks=()) -> None:
  """Each kernel body (its default chunk: 32 Triton, 64 Mosaic GPU; tuned blocks) and the
  XLA path; with `mode_blocks`, Mosaic GPU also with those modes per program of the
  backward's state terms (fewer: more programs and more float32 shares of dx; the tuned
  entry has 4)."""
  args = inputs(length, dtype, batch)[:6]
  names = {"triton": "Triton kernel", "mosaic_gpu": "Mosaic GPU kernel"}
  paths = {names[b]: functools.partial(kernel.frac_scan, backend=b, interpret=False)
           for b in backends}
  paths.update({f"Mosaic GPU m_block={m}": functools.partial(
      kernel.frac_scan, backend="mosaic_gpu", interpret=False, m_block=m) for m in mode_blocks})
  paths["XLA chunked"] = ops.frac_scan
  times = {}
  for name, op in paths.items():
    fwd = lambda *a, op=op: op(*a)[0]
    step = jax.grad(lambda *a, op=op: jnp.sum(op(*a)[0].astype(jnp.float32) ** 2),
                    argnums=tuple(range(6)))
    times[name] = (wall_seconds(fwd, *args, repeats=10), wall_seconds(step, *args, repeats=10))
  base = times["XLA chunked"]
  for name, (fwd_s, step_s) in times.items():
    print(f"  B={batch} L={length} {jnp.dtype(dtype).name} {name:22s} fwd {fwd_s * 1e3:7.2f} ms"
          f"  fwd+bwd {step_s * 1e3:7.2f} ms  (XLA/this: fwd {base[0] / fwd_s:.2f}x,"
          f" fwd+bwd {base[1] / step_s:.2f}x)", flush=True)


def main(argv) -> int:
  if argv[1:2] == ["check"]:  # one check, run by check_in_subprocess
    backend, dtype, length, tol = argv[2:]
    return 0 if check(backend, jnp.dtype(dtype), int(length), float(tol)) else 1
  print(f"FRAC scan, H={HEADS} P={P} N={N} M={M}, devices: {jax.devices()}")
  if not ON_GPU:  # smoke test of this script: interpreted kernels, tiny size
    ok = check("triton", jnp.float32, 40, 1e-4)
    if dispatch.mosaic_gpu_available():
      ok &= check("mosaic_gpu", jnp.bfloat16, 40, 5e-2)
    return 0 if ok else 1
  backends = ["triton"]
  auto = dispatch.gpu_backend('frac_scan', ('triton', 'mosaic_gpu'))
  print(f"  backend=None picks {auto} for bf16")
  # Triton dots on float32 inputs run as IEEE float32 (precision=HIGHEST in the tile math).
  ok = check("triton", jnp.float32, 1000, 1e-3) & check("triton", jnp.bfloat16, 2048, 5e-2)
  if HOPPER:  # bf16 only: dispatch refuses Mosaic GPU's float32 kernels on a chip
    if check_in_subprocess("benchmarks.gpu_frac", "mosaic_gpu", "bfloat16", "1000", "5e-2"):
      backends.append("mosaic_gpu")
    else:
      ok = False
  for length in (4096, 16384):
    timing(length, jnp.bfloat16, batch=8, backends=backends)
  if "mosaic_gpu" in backends:  # one batch element: 4 groups (a program per chunk fills the GPU)
    timing(16384, jnp.bfloat16, batch=1, backends=backends, mode_blocks=(1, 2))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
