"""Pack3D on a GPU: compiled kernels (Triton; Mosaic GPU for bf16 on Hopper) vs reference, and
fwd+bwd time vs dense attention (XLA and cuDNN).

Run by benchmarks/gpu_check.sh; prints one line per check, exits non-zero on a mismatch.
  python -m benchmarks.gpu_pack3d
On Hopper the Mosaic GPU check runs in its own process (a kernel fault poisons the process's
CUDA context) and that body is timed only if it passed. On a machine without a GPU the
kernel runs interpreted and nothing is timed (a smoke test).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import check_in_subprocess, report_errors, wall_seconds
from neurips26_jax.jaxops import pack3d as ops
from neurips26_jax.jaxops import packing
from neurips26_jax.jaxops.pack3d_layout import cube_layout
from neurips26_jax.pallas_kernels import pack3d_attention as kernel
from neurips26_jax.pallas_kernels.dispatch import compute_capability, mosaic_gpu_available

HEADS, HEAD_DIM = 2, 48
ON_GPU = jax.default_backend() == "gpu"
# The Mosaic GPU body beside Triton where it compiles: Hopper, 16-bit inputs, jax >= 0.11.2.
HOPPER = ON_GPU and mosaic_gpu_available() and (compute_capability() or (0,))[0] == 9


def packed(shapes, layout="hilbert"):
  """coords [1, N, 3], field_ids [1, N] for fields of `shapes` packed along `layout`."""
  _, coords, field_ids = packing.pack_fields([np.zeros(s + (1,)) for s in shapes])
  perm, _ = packing.layout_permutation(coords, field_ids, layout)
  return coords[perm][None], field_ids[perm][None]


def qkv(n, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(kk, (1, n, HEADS, HEAD_DIM)).astype(dtype) for kk in keys]


def errors(dtype, shapes, **options):
  """Relative max errors of (o, dq, dk, dv) of the kernel, called with `options`, against the
  float32 reference computed on the CPU, for fields of `shapes` in Hilbert order. (On an H200
  with jax 0.11.2 the reference and the XLA path computed on the GPU disagree with the CPU
  when far cubes exist: `cpu_vs_gpu`, benchmarks/README.md.)"""
  coords, field_ids = packed(shapes)
  args = qkv(coords.shape[1], dtype)
  loss = lambda op, q, k, v: jnp.sum(jnp.sin(op(q, k, v, coords, field_ids).astype(jnp.float32)))
  run = lambda op: jax.jit(lambda *a: (op(*a, coords, field_ids),
                                       jax.grad(functools.partial(loss, op), argnums=(0, 1, 2))(*a)))
  math = {k: options.pop(k) for k in ("block_bias", "radius_blocks") if k in options}
  options = {"interpret": False if ON_GPU else True, **options, **math}
  fast = jax.tree.leaves(run(functools.partial(kernel.pack3d_attention, **options))(*args))
  reference = functools.partial(ops.pack3d_attention_reference, **math)
  with jax.default_device(jax.devices("cpu")[0]):
    ref = jax.tree.leaves(run(reference)(*jax.device_put([a.astype(jnp.float32) for a in args],
                                                         jax.devices("cpu")[0])))
  return [float(jnp.max(jnp.abs(f.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
          for f, r in zip(fast, ref, strict=True)]


# Two fields that are not multiples of the 4^3 cube; one field of 8 whole cubes.
CASES = {"two odd fields": [(13, 17, 9), (10, 6, 11)], "8 whole cubes": [(8, 8, 8)]}
# On a mismatch, which change makes it go away: no far cubes (local attention only), the
# Triton body interpreted on this machine (same math, no GPU compile).
VARIANTS = {"radius 8 (no far cubes)": {"radius_blocks": 8},
            "triton interpreted": {"interpret": True, "backend": "triton"}}


def cpu_vs_gpu(dtype, shapes) -> None:
  """Where the GPU and the CPU disagree: the cube layout's fields, the reference, the XLA
  path and the interpreted Triton body, each computed on both (relative max differences)."""
  coords, field_ids = packed(shapes)
  args = qkv(coords.shape[1], dtype)
  diff = lambda a, b: float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)))
                            / max(float(jnp.max(jnp.abs(jnp.asarray(b, jnp.float32)))), 1e-30))
  on = lambda device, fn: jax.device_get(jax.jit(fn, device=device)(*args))
  cpu, gpu = jax.devices("cpu")[0], jax.devices()[0]
  layouts = {}
  for name, device in (("cpu", cpu), ("gpu", gpu)):
    with jax.default_device(device):
      layouts[name] = jax.device_get(cube_layout(coords, field_ids, slots_per_cube=64))
  for field in ("slot", "count", "keys", "neighbours", "num_neighbours"):
    print(f"    layout.{field} gpu vs cpu: {diff(getattr(layouts['gpu'], field), getattr(layouts['cpu'], field)):.2e}")
  paths = {"reference": lambda q, k, v: ops.pack3d_attention_reference(q, k, v, coords, field_ids),
           "XLA path": lambda q, k, v: ops.pack3d_attention(q, k, v, coords, field_ids),
           "triton interpreted": lambda q, k, v: kernel.pack3d_attention(
               q, k, v, coords, field_ids, interpret=True, backend="triton")}
  outs = {name: (on(gpu, fn), on(cpu, fn)) for name, fn in paths.items()}
  for name, (g, c) in outs.items():
    print(f"    {name}: gpu vs cpu {diff(g, c):.2e}; gpu vs cpu reference "
          f"{diff(g, outs['reference'][1]):.2e}", flush=True)


def check(dtype, tol, backend=None) -> bool:
  """Every case with the kernel body `backend` (None: the default: interpreted off a GPU)."""
  ok = True
  for case, shapes in CASES.items():
    errs = errors(dtype, shapes, backend=backend)
    n = packed(shapes)[0].shape[1]
    passed = max(errs) <= tol
    ok &= passed
    print(f"  {jnp.dtype(dtype).name} {backend or 'default'} {case} N={n}: o, dq, dk, dv rel. "
          f"max errors " + ", ".join(f"{e:.2e}" for e in errs)
          + f" ({'ok' if passed else 'FAIL'})", flush=True)
    if not passed and ON_GPU and dtype == jnp.float32:
      try:
        for name, options in VARIANTS.items():
          print(f"    with {name}: " + ", ".join(f"{e:.2e}" for e in errors(dtype, shapes, **options)),
                flush=True)
        cpu_vs_gpu(dtype, shapes)
      except Exception as e:  # noqa: BLE001  (triage reports and goes on)
        print(f"    triage stopped: {str(e).splitlines()[0][:200]}", flush=True)
  return ok


def timing(shape, dtype, backends) -> None:
  coords, field_ids = packed([shape], layout="raster_zyx")
  n = coords.shape[1]
  args = qkv(n, dtype, seed=1)
  variants = {
      "dense XLA": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
      "dense cuDNN": lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                  implementation="cudnn"),
      **{f"pack3d {name}": functools.partial(
          lambda q, k, v, b: kernel.pack3d_attention(q, k, v, coords, field_ids,
                                                     interpret=False, backend=b), b=b)
         for name, b in (("Triton", "triton"), ("Mosaic GPU", "mosaic_gpu")) if b in backends},
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
    dense = (fwd_s, step_s) if name.startswith("dense") and dense is None else dense
    ratio = (f"dense XLA/this fwd {dense[0] / fwd_s:.2f}x, fwd+bwd {dense[1] / step_s:.2f}x"
             if dense else "dense not run")
    print(f"  N={n} {jnp.dtype(dtype).name} {name:22s} fwd {fwd_s * 1e3:8.2f} ms  "
          f"fwd+bwd {step_s * 1e3:8.2f} ms  ({ratio})")


def main(argv) -> int:
  if argv[1:2] == ["check"]:  # one check, run by check_in_subprocess
    backend, dtype, tol = argv[2:]
    return 0 if check(jnp.dtype(dtype), float(tol), backend) else 1
  print(f"Pack3D attention, H={HEADS} D={HEAD_DIM}, devices: {jax.devices()}")
  gpu_body = "triton" if ON_GPU else None  # the Mosaic GPU body is checked on its own below
  ok = check(jnp.float32, 2e-3, gpu_body) & check(jnp.bfloat16, 5e-2, gpu_body)
  if not ON_GPU:
    return 0 if ok else 1
  backends = ["triton"]
  if HOPPER:  # bf16 only: dispatch refuses Mosaic GPU's float32 kernels on a chip
    if check_in_subprocess("benchmarks.gpu_pack3d", "mosaic_gpu", "bfloat16", "5e-2"):
      backends.append("mosaic_gpu")
    else:
      ok = False
  for shape in ((16, 32, 32), (32, 32, 64)):  # 16k and 65k tokens
    timing(shape, jnp.bfloat16, backends)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
