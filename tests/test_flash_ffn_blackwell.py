"""FlashFFN's Mosaic GPU kernels on Blackwell (tcgen05 MMAs into tensor memory, traced for a
B200 with `target_chip`): forward and every gradient against the independent float64
reference of `tests/independent.py` through the Mosaic GPU interpreter with its race
detector (odd sizes, random inputs), float32 by default and bf16 and other shapes in the slow
run; `backend=None` lowers to Mosaic GPU for a B200 target with bf16 inputs (Triton for
float32); Blackwell's tile rule. How outputs and gradients are compared:
`tests/independent_checks.py`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_ffn as kernel
from pallas_kernels import dispatch
from pallas_kernels.dispatch import target_chip
from tests import independent as ind
from tests import kernel_checks
from tests import test_flash_ffn as hopper
from tests.independent_checks import as_f64, cast, check, check_directional
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu
from tests.test_flash_ffn_independent import (FFN_DIRS, FFN_INPUTS, FFN_NAMES, FFN_W,
                                              _ffn_args, ffn_reference_derivatives)

pytestmark = needs_mosaic_gpu
F32, BF16 = jnp.float32, jnp.bfloat16
CHIP = "gpu-b200"
# FFN_SHAPE (L = 133: two 128-token tiles, the second mostly padding; d_e = 24 in 16-wide
# tiles inside one 128-row dK/dU/dV tile, 32-token dK/dU/dV steps; d_h = 8).
BLOCKS = dict(block_q=128, block_inter=16, block_q_dkv=32)
# Measured: f32 forward 2.1e-7, gradients <= 1.7e-7 (the independent test's 1e-5, ~50x
# above). bf16 (q, k, u, v and the cotangent in bf16, r float32; the reference at the
# rounded values): forward 2.9e-3, gradients <= 3.0e-3 (dK; dq 1.1e-3).
TOL = {F32: 1e-5, BF16: 6e-3}
GRAD_TOL = {F32: 1e-5, BF16: 1e-2}


def blackwell_op():
  return functools.partial(kernel.mhffn, interpret=mosaic_gpu_interpreter(),
                           backend="mosaic_gpu", **BLOCKS)


@functools.lru_cache(maxsize=None)
def run(dtype):
  """(o, VJP of the cotangent FFN_W) of the Blackwell kernels on FFN_INPUTS in `dtype`, traced
  for a B200 (forward and backward are traced inside the context)."""
  op = blackwell_op()

  def fn(*args):
    out, vjp = jax.vjp(op, *args)
    return out, vjp(cast(FFN_W, dtype))

  with target_chip(CHIP):
    return jax.jit(fn)(*_ffn_args(dtype))


@functools.lru_cache(maxsize=None)
def reference_derivatives(dtype):
  """The float64 directional derivatives of sum(W * mhffn) at the inputs and cotangent W the
  kernels see in `dtype` (bf16: rounded, so only the kernels' own rounding counts)."""
  if dtype == F32:
    return ffn_reference_derivatives()
  args, w = tuple(as_f64(a) for a in _ffn_args(dtype)), as_f64(cast(FFN_W, dtype))
  loss = lambda *a: float(np.sum(w * ind.mhffn(*a)))
  return tuple(ind.directional_derivative(loss, args, i, FFN_DIRS[i]) for i in range(5))


def check_against_independent(dtype):
  out, grads = run(dtype)
  assert out.dtype == dtype
  args = FFN_INPUTS if dtype == F32 else tuple(as_f64(a) for a in _ffn_args(dtype))
  check(out, ind.mhffn(*args), rtol=TOL[dtype], name=f"blackwell {jnp.dtype(dtype).name} out")
  check_directional(grads, reference_derivatives(dtype), FFN_DIRS, rtol=GRAD_TOL[dtype],
                    name=FFN_NAMES)


def test_forward_and_grads_f32():
  check_against_independent(F32)


@pytest.mark.slow
def test_forward_and_grads_bf16():
  check_against_independent(BF16)


# The Hopper tests' other layouts and loop shapes (d_h = 128 flat, d_h = 24 head-major, one
# expert and token tile) against the einsum reference, f32 and bf16 (bf16: within 3x the XLA
# path's error, tests/kernel_checks.py).
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", hopper.MOSAIC_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_other_shapes(shape, dtype, monkeypatch):
  monkeypatch.setitem(hopper.PATHS, "mosaic_gpu_blackwell", blackwell_op())
  hopper.compiled.cache_clear()
  with target_chip(CHIP):
    hopper.check_against_reference("mosaic_gpu_blackwell", dtype, shape=shape)
  hopper.compiled.cache_clear()


@pytest.mark.parametrize("dtype, backend", [(BF16, "mosaic_gpu"), (F32, "triton")],
                         ids=["bf16", "f32"])
def test_auto_picks_mosaic_gpu_on_blackwell_for_bf16(dtype, backend):
  """backend=None lowers to Mosaic GPU (the mosaic_gpu_v2 custom call) for a B200 target with
  bf16 inputs and to Triton for float32 (forward: one kernel; gradient: three)."""
  args = hopper.paper_shape(dtype)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, kernel.mhffn),
                  argnums=(0, 1, 2, 3, 4))
  other = {"mosaic_gpu": "triton", "triton": "mosaic_gpu"}[backend]
  for fn, count in ((kernel.mhffn, 1), (grad, 3)):
    text = kernel_checks.export_mlir(fn, "cuda", *args,
                                     device_kind=kernel_checks.BLACKWELL_DEVICE_KIND)
    assert text.count(kernel_checks.BACKEND_CALL[backend]) == count
    assert kernel_checks.BACKEND_CALL[other] not in text


def test_auto_takes_triton_on_blackwell_for_wide_heads():
  """d_h > 128 (here 192): the Blackwell dK/dU/dV kernel's tiles would not fit shared
  memory, so backend=None lowers to Triton for a B200 (Mosaic GPU on Hopper)."""
  spec = lambda *s, d=BF16: jax.ShapeDtypeStruct(s, d)
  args = (spec(1, 256, 2, 192), spec(1, 256, 2, 2, d=F32), *(spec(2, 2, 128, 192),) * 3)
  for device_kind, backend in ((kernel_checks.BLACKWELL_DEVICE_KIND, "triton"),
                               (kernel_checks.HOPPER_DEVICE_KIND, "mosaic_gpu")):
    text = kernel_checks.export_mlir(kernel.mhffn, "cuda", *args, device_kind=device_kind)
    assert kernel_checks.BACKEND_CALL[backend] in text, device_kind


@pytest.mark.parametrize("blocks, d_h", [(dict(block_q=64), 8), (dict(block_inter=256), 8),
                                         ({}, 136)], ids=["block_q", "block_inter", "d_h"])
def test_blackwell_tiles_are_128_rows(blocks, d_h):
  """tcgen05's M is 128 here: other token tiles, d_e tiles beyond 128 rows and heads wider
  than 128 are refused."""
  args = hopper.make_inputs(F32, shape=(1, 9, 1, d_h, 1, 256))
  op = functools.partial(kernel.mhffn, interpret=True, backend="mosaic_gpu", **blocks)
  with target_chip(CHIP), pytest.raises(ValueError, match="on Blackwell"):
    op(*args)


def test_unknown_blackwell_chip_gets_the_b200_tiles(monkeypatch):
  """A compute-capability-10 GPU that is not a B200 by name (a B300, 10.3) gets the B200's
  tuned entries, whose 128-row tiles the Blackwell kernels need (the generic ones are
  Hopper's 64)."""
  monkeypatch.setattr(dispatch, "current_chip", lambda: None)
  monkeypatch.setattr(dispatch, "compute_capability", lambda: (10, 3))
  for dtype in ("float32", "bfloat16"):
    assert (kernel.BlockSizes.for_backend("mosaic_gpu", dtype)
            == kernel.TUNED["mosaic_gpu", CHIP, dtype])
