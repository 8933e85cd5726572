"""FlashFFN on a GPU: each compiled kernel body (Triton; Mosaic GPU where `backend=None` picks
it: Hopper, Blackwell) against the float32 reference, then fwd and fwd+bwd time side by side
with the XLA path and SwiGLU.

Run by benchmarks/gpu_check.sh; prints one line per check, exits non-zero on a mismatch.
  python -m benchmarks.gpu_flash_ffn
On a machine without a GPU the kernels run interpreted on a short sequence (a smoke test).

Shapes: the paper's 370M model (d = 1024, H = 8, d_h = 128, E = 11, d_e = 256; its SwiGLU
has d_ff = 2752). Op rows time `mhffn` alone on [B, L, H, d_h] inputs, with TFLOP/s from
6 B L H E d_e d_h forward FLOPs (three matmuls) and 3x that for fwd+bwd; layer rows time
the whole layers (FlashFFN adds its [d, d] in and out projections).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import check_in_subprocess, report_errors, wall_seconds
from neurips26_jax.jaxops import flash_ffn as ops
from neurips26_jax.models import FlashFFN, SwiGLU
from neurips26_jax.pallas_kernels import dispatch
from neurips26_jax.pallas_kernels import flash_ffn as kernel
from neurips26_jax.pallas_kernels.flash_ffn import blocks
from neurips26_jax.pallas_kernels.flash_ffn.tiles import mosaic_gpu_generations

D, HEADS, EXPERTS, D_E, D_FF_SWIGLU = 1024, 8, 11, 256, 2752
D_H = D // HEADS
ON_GPU = jax.default_backend() == "gpu"


# The generations whose Mosaic GPU kernel takes these heads: the op's own rule.
GENERATIONS = mosaic_gpu_generations(D_H, jnp.bfloat16)


def auto_backend(dtype=jnp.bfloat16) -> str:
  """The kernel body `backend=None` runs on this GPU for `dtype` at these shapes."""
  return dispatch.gpu_backend("mhffn", ("triton", "mosaic_gpu"), dtype, GENERATIONS)


def gpu_backends() -> tuple[str, ...]:
  """The kernel bodies this GPU compiles for bfloat16: Triton everywhere, and Mosaic GPU where
  its body serves the chip (Hopper, Blackwell), whether or not `backend=None` picks it."""
  serves = dispatch.mosaic_gpu_serves(("triton", "mosaic_gpu"), jnp.bfloat16, GENERATIONS)
  return ("triton", "mosaic_gpu") if serves else ("triton",)


# Kernel-body variants timed beside the bodies `gpu_backends` names (Hopper, 16-bit): the
# warp-specialized forward (`mosaic_gpu_ws.py`, measured on no chip before this script) at
# the tuned tiles and with 64-wide table tiles (every HGMMA 64x128x16 in its SASS).
WS_VARIANTS = {"mosaic_gpu ws": dict(compute_wgs=2),
               "mosaic_gpu ws bi64": dict(compute_wgs=2, block_inter=64)}


def bodies(dtype=jnp.bfloat16) -> dict[str, dict]:
  """{name: mhffn keyword arguments} of every kernel body to check and time for `dtype`."""
  out = {b: dict(backend=b) for b in gpu_backends()
         if b != "mosaic_gpu" or dispatch.mosaic_gpu_dtype_ok(dtype)}
  if "mosaic_gpu" in out and (dispatch.compute_capability() or (0,))[0] == dispatch.HOPPER:
    out.update({n: dict(backend="mosaic_gpu", **kw) for n, kw in WS_VARIANTS.items()})
  return out


def op_inputs(batch: int, length: int, dtype, seed: int = 0):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, length, HEADS, D_H)).astype(dtype)
  r = jax.nn.softmax(jax.random.normal(ks[1], (batch, length, HEADS, EXPERTS)))
  k, u, v = (0.05 * jax.random.normal(kk, (HEADS, EXPERTS, D_E, D_H)).astype(dtype)
             for kk in ks[2:])
  return q, r, k, u, v


def check(body, dtype, length, tol) -> bool:
  """Output and the five gradients of one kernel body (a `bodies` name, or "mosaic" for
  the interpreted smoke test) against the float32 reference."""
  args = op_inputs(1, length, dtype)
  loss = lambda op, *a: jnp.sum(jnp.sin(op(*a).astype(jnp.float32)))
  run = lambda op: jax.jit(lambda *a: (op(*a), jax.grad(functools.partial(loss, op),
                                                        argnums=range(5))(*a)))
  interpret = None if ON_GPU else True
  kwargs = bodies(dtype)[body] if ON_GPU else dict(backend=body)
  fast = run(functools.partial(kernel.mhffn, interpret=interpret, **kwargs))(*args)
  ref = run(ops.mhffn_reference)(*(a.astype(jnp.float32) for a in args))
  return report_errors(f"{body} {jnp.dtype(dtype).name} L={length}",
                       ["o"] + [f"d{n}" for n in "qrkuv"], jax.tree.leaves(fast),
                       jax.tree.leaves(ref), tol)


def fwd_and_step(fn):
  """fn(*args) -> array, and the gradient step of sum(fn(*args)^2) in every argument."""
  return fn, lambda *a: jax.grad(lambda *b: jnp.sum(fn(*b).astype(jnp.float32) ** 2),
                                 argnums=tuple(range(len(a))))(*a)


def time_ops(batch: int, length: int, dtype) -> None:
  """mhffn per kernel body and the chunked XLA path, side by side."""
  args = op_inputs(batch, length, dtype, seed=1)
  flops = 6 * batch * length * HEADS * EXPERTS * D_E * D_H
  paths = {f"mhffn {b}": functools.partial(kernel.mhffn, interpret=False, **kw)
           for b, kw in bodies(dtype).items()}
  paths["mhffn XLA chunked"] = ops.mhffn
  times = {}
  for name, op in paths.items():
    fwd, step = fwd_and_step(op)
    try:
      times[name] = (wall_seconds(fwd, *args, repeats=10), wall_seconds(step, *args, repeats=10))
    except Exception as e:  # noqa: BLE001  (a benchmark reports a failure and goes on)
      print(f"  B={batch} L={length} {name:22s} not run: {str(e).splitlines()[0][:160]}")
  base = times.get("mhffn XLA chunked")
  for name, (fwd_s, step_s) in times.items():
    ratio = (f"XLA/this fwd {base[0] / fwd_s:.2f}x, fwd+bwd {base[1] / step_s:.2f}x"
             if base else "")
    print(f"  B={batch} L={length} {jnp.dtype(dtype).name} {name:27s} fwd {fwd_s * 1e3:7.2f} ms"
          f" ({flops / fwd_s / 1e12:5.0f} TFLOP/s)  fwd+bwd {step_s * 1e3:7.2f} ms"
          f" ({3 * flops / step_s / 1e12:5.0f} TFLOP/s)  {ratio}", flush=True)


@contextlib.contextmanager
def tuned_mosaic_gpu(**fields):
  """The tuned 16-bit Mosaic GPU entries with `fields` replaced while inside (a layer takes
  no block sizes; functions jitted inside trace with them)."""
  saved = {key: b for key, b in blocks.TUNED.items()
           if key[0] == "mosaic_gpu" and key[2] == "bfloat16"}
  blocks.TUNED.update({key: dataclasses.replace(b, **fields) for key, b in saved.items()})
  try:
    yield
  finally:
    blocks.TUNED.update(saved)


def time_layers(length: int, dtype) -> None:
  """SwiGLU against the FlashFFN layer on its default kernel and on the XLA path."""
  x = jax.random.normal(jax.random.key(1), (1, length, D), dtype)
  layers = {
      "SwiGLU (XLA)": SwiGLU(D, D_FF_SWIGLU, dtype=dtype, rngs=nnx.Rngs(0)),
      "FlashFFN kernel": FlashFFN(D, HEADS, EXPERTS, D_E, impl="pallas", interpret=False,
                                  dtype=dtype, rngs=nnx.Rngs(0)),
      "FlashFFN XLA": FlashFFN(D, HEADS, EXPERTS, D_E, impl="xla", dtype=dtype,
                               rngs=nnx.Rngs(0)),
  }
  if "mosaic_gpu ws" in bodies(dtype):  # the same layer, its forward kernel the warp-specialized one
    layers["FlashFFN kernel ws"] = layers["FlashFFN kernel"]
  times = {}
  for name, layer in layers.items():
    graphdef, params = nnx.split(layer)
    fwd, step = fwd_and_step(lambda p, x, g=graphdef: nnx.merge(g, p)(x))
    with tuned_mosaic_gpu(**(WS_VARIANTS["mosaic_gpu ws"] if name.endswith(" ws") else {})):
      times[name] = (wall_seconds(fwd, params, x, repeats=10),
                     wall_seconds(step, params, x, repeats=10))
  base = times["SwiGLU (XLA)"]
  for name, (fwd_s, step_s) in times.items():
    print(f"  L={length} {jnp.dtype(dtype).name} {name:18s} fwd {fwd_s * 1e3:7.2f} ms  "
          f"fwd+bwd {step_s * 1e3:7.2f} ms  (SwiGLU/this fwd {base[0] / fwd_s:.2f}x, "
          f"fwd+bwd {base[1] / step_s:.2f}x)", flush=True)


# (dtype, length, tolerance): float32 tiles run as TF32 products (as XLA's float32 dots on GPU
# by default), so 1e-2; odd lengths exercise the padded last token tile.
CHECKS = (("float32", 1024, 1e-2), ("float32", 1000, 1e-2), ("bfloat16", 4096, 5e-2),
          ("bfloat16", 1000, 5e-2))


def main(argv) -> int:
  if argv[1:2] == ["check"]:  # one check, run by check_in_subprocess
    backend, dtype, length, tol = argv[2:]
    return 0 if check(backend, jnp.dtype(dtype), int(length), float(tol)) else 1
  print(f"FlashFFN d={D} H={HEADS} E={EXPERTS} d_e={D_E}, devices: {jax.devices()}")
  if not ON_GPU:  # smoke test of this script: interpreted Mosaic kernel, short sequence
    return 0 if check("mosaic", jnp.float32, 40, 1e-4) else 1
  backends = gpu_backends()
  print(f"  kernel bodies: {backends}; backend=None picks {auto_backend()} for bfloat16, "
        f"{auto_backend(jnp.float32)} for float32")
  # A forced Mosaic GPU kernel compiles for 16-bit inputs only (dispatch.mosaic_gpu_dtype_ok).
  # Each body through every check; the variants through the odd-length bf16 one (time).
  ok = all([check_in_subprocess("benchmarks.gpu_flash_ffn", b, *map(str, c))
            for c in CHECKS for b in bodies(jnp.dtype(c[0]))
            if b not in WS_VARIANTS or c == CHECKS[-1]])
  time_ops(4, 16384, jnp.bfloat16)
  for length in (4096, 16384):
    time_layers(length, jnp.bfloat16)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv))
