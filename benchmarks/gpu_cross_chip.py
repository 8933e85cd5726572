"""Every implementation of every op on this chip against a float64 CPU reference.

"The kernel matches the reference" proves nothing when the reference itself is wrong on the
chip (Pack3D's dense reference and XLA path disagreed with their CPU results on an H200).
So here each impl (the jnp reference, the XLA path, the kernel as dispatched, and each
kernel body forced) runs on the default device at odd shapes, forward, float32 and
bfloat16, and is compared with `tests/independent.py` (float64 numpy written from
DESIGN.md alone, on the CPU) of the same inputs as rounded to the dtype. One line per (op, impl, dtype): relative max error and its
bound; exit status 1 if any is over. Run by benchmarks/gpu_check.sh:
  python -m benchmarks.gpu_cross_chip
Without a GPU it checks the reference, the XLA path and the interpreted kernel (a smoke).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from neurips26_jax.jaxops import flash_ffn as ffn_ops
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops import pack3d as pack3d_ops
from neurips26_jax.jaxops import packing
from neurips26_jax.pallas_kernels import flash_ffn, frac_scan, pack3d_attention
from neurips26_jax.pallas_kernels.dispatch import compute_capability, mosaic_gpu_available
from tests import independent

ON_GPU = jax.default_backend() == "gpu"
HOPPER = ON_GPU and mosaic_gpu_available() and (compute_capability() or (0,))[0] == 9
# Relative max error bounds: float32 allows TF32 products (Triton's float32 dots), bfloat16
# its 8-bit mantissa through two matmuls.
BOUND = {"float32": 2e-3, "bfloat16": 2e-2}


def _forced(*backends):
  """The kernel bodies to force on this machine, beside the dispatched one."""
  return [b for b in backends if ON_GPU and (b != "mosaic_gpu" or HOPPER)]


def flash_ffn_case(rng):
  q = rng.standard_normal((1, 77, 2, 64))
  logits = rng.standard_normal((1, 77, 2, 3))
  r = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  tables = [rng.standard_normal((2, 3, 40, 64)) / 8 for _ in range(3)]
  inputs = (q, r, *tables)
  impls = {"reference": ffn_ops.mhffn_reference, "xla": ffn_ops.mhffn,
           "kernel": flash_ffn.mhffn}
  for body in _forced("triton", "mosaic_gpu"):
    impls[f"kernel {body}"] = lambda *a, body=body: flash_ffn.mhffn(*a, backend=body)
  return inputs, (0, 2, 3, 4), impls, independent.mhffn


def frac_case(rng):
  b, l, h, p, n, m = 1, 45, 2, 64, 16, 8
  x = rng.standard_normal((b, l, h, p))
  dt = np.abs(rng.standard_normal((b, l, h))) * 0.5 + 0.05
  bb, cc = rng.standard_normal((b, l, h, n)), rng.standard_normal((b, l, h, n))
  rates = np.exp(rng.uniform(np.log(1e-3), 0.0, (h, m)))
  weights = rng.dirichlet(np.ones(m), h)
  inputs = (x, dt, bb, cc, rates, weights)
  impls = {"reference": lambda *a: frac_ops.frac_scan_reference(*a)[0],
           "xla": lambda *a: frac_ops.frac_scan(*a)[0],
           "kernel": lambda *a: frac_scan.frac_scan(*a)[0]}
  for body in _forced("triton", "mosaic_gpu"):
    impls[f"kernel {body}"] = lambda *a, body=body: frac_scan.frac_scan(*a, backend=body)[0]
  return inputs, (0, 2, 3), impls, lambda *a: independent.frac_scan(*a)[0]


def pack3d_case(rng):
  _, coords, field_ids = packing.pack_fields([np.zeros((5, 6, 7, 1)), np.zeros((3, 5, 2, 1))])
  perm = rng.permutation(coords.shape[0])                       # any packing order
  coords, field_ids = coords[perm][None], field_ids[perm][None]
  q, k, v = (rng.standard_normal((1, coords.shape[1], 2, 48)) for _ in range(3))
  inputs = (q, k, v)
  impls = {"reference": pack3d_ops.pack3d_attention_reference, "xla": pack3d_ops.pack3d_attention,
           "kernel": pack3d_attention.pack3d_attention}
  for body in _forced("triton", "mosaic_gpu"):
    impls[f"kernel {body}"] = lambda *a, body=body: pack3d_attention.pack3d_attention(
        *a, backend=body)
  bound = {name: (lambda *a, fn=fn: fn(*a, coords, field_ids)) for name, fn in impls.items()}
  return inputs, (0, 1, 2), bound, lambda *a: independent.pack3d_attention(*a, coords, field_ids)


def main() -> int:
  print(f"devices: {jax.devices()}; Hopper Mosaic GPU bodies: {HOPPER}", flush=True)
  rng = np.random.default_rng(0)
  failed = 0
  for op, case in (("flash_ffn", flash_ffn_case), ("frac_scan", frac_case),
                   ("pack3d", pack3d_case)):
    inputs, cast, impls, truth = case(rng)
    for dtype in ("float32", "bfloat16"):
      args = [jnp.asarray(x, dtype if i in cast else "float32") for i, x in enumerate(inputs)]
      want = truth(*(np.asarray(a, np.float64) for a in args))   # of the inputs as rounded
      for name, fn in impls.items():
        if name.endswith("mosaic_gpu") and dtype == "float32":
          continue                         # float32 Mosaic GPU kernels fault on an H200
        try:
          got = np.asarray(jax.jit(fn)(*args), np.float64)
          err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
          ok = err <= BOUND[dtype]
          line = f"{err:.2e} (bound {BOUND[dtype]:.0e}) {'ok' if ok else 'OVER'}"
        except Exception as e:  # noqa: BLE001  (one impl's failure is reported, the rest run)
          ok, line = False, f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        failed += not ok
        print(f"  {op:9s} {name:18s} {dtype:8s} {line}", flush=True)
  print(f"{failed} over their bound" if failed else "every impl within its bound")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
