"""FRAC's Mosaic GPU kernel (Hopper): against the independent float64 reference of
`tests/independent.py` through the Mosaic GPU interpreter with its race detector (odd sizes,
several chunks, column and mode blocks, padding everywhere), float32 and bf16, the output,
the final state and every gradient; which GPU kernel `backend=None` lowers to per chip,
dtype and chunk; and the chunk rule's error. How outputs and gradients are compared:
`tests/independent_checks.py`."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.pallas_kernels import frac_scan as kernel
from tests import independent as ind
from tests import kernel_checks
from tests.independent_checks import as_f64, cast, check, check_directional
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu
from tests.test_frac_independent import FRAC_NAMES

pytestmark = needs_mosaic_gpu
F32, BF16 = jnp.float32, jnp.bfloat16

# (Bt, L, H, P, N, M). The default: 2 chunks of 64 (the second partial), P = 70 in two
# 64-column blocks (the second mostly padding), N = 5 padded to 16, M = 5 padded to 8 (the
# backward's state terms in two blocks of 4, the second mostly padding).
SHAPE = (1, 100, 2, 70, 5, 5)
# A sequence shorter than a chunk (the plan's 32-token chunk, padded to 64 inside the
# kernel: the only case of the kernel's own token padding, so it runs by default too).
SHORT = (1, 20, 1, 8, 3, 2)
# One 64-token chunk holding the whole (odd) sequence, with P, N exact and 16 modes (4
# blocks); two full chunks and P = 130 (padded to 256: four column blocks), 3 modes; N = 20
# (padded to 32: two modes per program and per own-states matmul batch; 6 modes padded to 8,
# so four mode blocks, the last all padding).
SLOW_SHAPES = [(2, 37, 1, 64, 16, 16), (1, 128, 1, 130, 16, 3), (1, 100, 1, 64, 20, 6)]
# f32: measured here outputs <= 3.6e-7, gradients <= 4.6e-7, so 2e-6 (tighter than
# tests/test_frac_independent.py's shared 1e-5: a dropped small term shows). bf16 (x, b, c in bf16, the rest float32), measured over these shapes: y <= 4.5e-3
# (mostly y's own rounding; the XLA path's is 3.7e-3 on the default case), state <= 3.7e-3
# (the update x^T (bd * decay) with bf16 operands, as on the XLA path), gradients (the
# relative L2 error of check_directional) <= 3.6e-3.
F32_TOL = 2e-6
BF16_TOL, BF16_GRAD_TOL = 1e-2, 1e-2
DTYPES = {F32: (F32,) * 7, BF16: (BF16, F32, BF16, BF16, F32, F32, F32)}


@functools.lru_cache(maxsize=None)
def _case(shape, seed=11):
  """Random inputs (never zeros), a cotangent of (y, state) and a direction per input."""
  bt, length, heads, p, n, m = shape
  rng = np.random.default_rng(seed)
  inputs = (rng.standard_normal((bt, length, heads, p)),
            np.log1p(np.exp(rng.standard_normal((bt, length, heads)))),     # softplus: dt > 0
            0.5 * rng.standard_normal((bt, length, heads, n)),
            0.5 * rng.standard_normal((bt, length, heads, n)),
            np.exp(rng.uniform(-5.0, 1.8, size=(heads, m))),                 # rates 0.007 .. 6
            rng.uniform(0.1, 1.0, size=(heads, m)),
            rng.standard_normal((bt, heads, m, n, p)))
  cotangents = (rng.standard_normal(inputs[0].shape), rng.standard_normal(inputs[6].shape))
  directions = tuple(rng.standard_normal(a.shape) for a in inputs)
  return inputs, cotangents, directions


def check_kernel(shape, dtype):
  """y, the final state and the seven gradients of the kernel (interpreted, races checked)
  against the float64 recurrence on the same (possibly bf16-rounded) inputs; y without a
  gradient equal to y with one."""
  inputs, (w_y, w_state), directions = _case(shape)
  args = tuple(cast(a, t) for a, t in zip(inputs, DTYPES[dtype], strict=True))
  op = functools.partial(kernel.frac_scan, backend="mosaic_gpu",
                         interpret=mosaic_gpu_interpreter())

  def run(*args):
    out, vjp = jax.vjp(op, *args)
    return out, vjp((cast(w_y, DTYPES[dtype][0]), cast(w_state, F32)))

  (y, state), grads = jax.jit(run)(*args)
  assert y.dtype == dtype and state.dtype == F32
  # Without a gradient the forward returns no chunk-start states; the rest is the same.
  np.testing.assert_array_equal(np.asarray(jax.jit(op)(*args)[0], np.float32),
                                np.asarray(y, np.float32))
  exact = [as_f64(a) for a in args]
  y_ref, state_ref = ind.frac_scan(*exact)
  tol = F32_TOL if dtype == F32 else BF16_TOL
  check(y, y_ref, rtol=tol, name=f"y {dtype.__name__}")
  check(state, state_ref, rtol=tol, name=f"state {dtype.__name__}")

  def loss(*args):
    y, state = ind.frac_scan(*args)
    return float(np.sum(as_f64(cast(w_y, DTYPES[dtype][0])) * y) + np.sum(w_state * state))

  derivs = [ind.directional_derivative(loss, exact, i, d) for i, d in enumerate(directions)]
  check_directional(grads, derivs, directions, name=FRAC_NAMES,
                    rtol=F32_TOL if dtype == F32 else BF16_GRAD_TOL)


@pytest.mark.parametrize("shape", [SHAPE, SHORT], ids=["chunks", "short"])
def test_matches_independent_reference(shape):
  check_kernel(shape, F32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPE, SHORT] + SLOW_SHAPES,
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_independent_reference_matrix(shape, dtype):
  if shape in (SHAPE, SHORT) and dtype == F32:
    pytest.skip("the default run's case")
  check_kernel(shape, dtype)


def _benchmark_shape(dtype):
  """The compile check's 16k head shape at an odd length: P = 64, N = 16, M = 16."""
  spec = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  return (spec(1, 333, 4, 64), spec(1, 333, 4, d=F32), spec(1, 333, 4, 16),
          spec(1, 333, 4, 16), spec(4, 16, d=F32), spec(4, 16, d=F32))


@pytest.mark.parametrize("measured, device_kind, dtype, chunk, backend", [
    (False, kernel_checks.HOPPER_DEVICE_KIND, BF16, None, "triton"),
    (True, kernel_checks.HOPPER_DEVICE_KIND, BF16, None, "mosaic_gpu"),
    (True, kernel_checks.HOPPER_DEVICE_KIND, F32, None, "triton"),
    (True, kernel_checks.HOPPER_DEVICE_KIND, BF16, 32, "triton"),
    (True, kernel_checks.CUDA_DEVICE_KIND, BF16, None, "triton"),
    (True, kernel_checks.BLACKWELL_DEVICE_KIND, BF16, None, "triton")],
    ids=["h100-bf16", "h100-bf16-measured", "h100-f32", "h100-bf16-chunk32", "a100-bf16",
         "b200-bf16"])
def test_auto_picks_the_gpu_kernel_per_chip(measured, device_kind, dtype, chunk, backend):
  """backend=None lowers to Triton on Hopper while the Mosaic GPU body has run on no chip
  (`dispatch.MEASURED_FASTER`). Once it is measured faster there: Mosaic GPU for a Hopper
  target with bf16 inputs and the default chunk (forward: the own-states and the outputs
  kernels; gradient: those and the backward's three), and Triton (forward; forward and
  backward) for float32, for a chunk Mosaic GPU does not serve and for an Ampere or a
  Blackwell target (the kernel is WGMMA's); never both."""
  op = functools.partial(kernel.frac_scan, chunk=chunk)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, op), argnums=tuple(range(6)))
  other = {"mosaic_gpu": "triton", "triton": "mosaic_gpu"}[backend]
  counts = {"mosaic_gpu": (2, 5), "triton": (1, 2)}[backend]
  with kernel_checks.measured_faster("frac_scan") if measured else contextlib.nullcontext():
    texts = [kernel_checks.export_mlir(fn, "cuda", *_benchmark_shape(dtype),
                                       device_kind=device_kind) for fn in (op, grad)]
  for text, count in zip(texts, counts):
    assert text.count(kernel_checks.BACKEND_CALL[backend]) == count
    assert kernel_checks.BACKEND_CALL[other] not in text


@pytest.mark.parametrize("shape, chunk, match", [
    (SHAPE, 32, "backend='mosaic_gpu' needs `chunk`=64 .* got chunk 32"),
    ((1, 70, 1, 8, 33, 2), None, "backend='mosaic_gpu' needs N <= 32 .* got 64"),
    ((1, 70, 1, 8, 20, 33), None, r"backend='mosaic_gpu' needs modes x N <= 1024 .* got 36 x 32")],
    ids=["chunk", "n", "modes"])
def test_forced_mosaic_gpu_names_what_it_cannot_serve(shape, chunk, match):
  """Mosaic GPU's chunk is 64 tokens (WGMMA's M), its N at most 32 and its padded modes x N
  at most what the outputs kernel's shared memory holds: anything else is a clear error
  when the backend is forced (backend=None takes Triton then)."""
  inputs, _, _ = _case(shape)
  args = tuple(cast(a, t) for a, t in zip(inputs, DTYPES[BF16], strict=True))
  with pytest.raises(ValueError, match=match):
    kernel.frac_scan(*args, chunk=chunk, backend="mosaic_gpu",
                     interpret=mosaic_gpu_interpreter())


@pytest.mark.parametrize("device_kind, match", [
    (kernel_checks.BLACKWELL_DEVICE_KIND, r"Blackwell \(10.x\) GPUs \(compute capability 10.0; "
     r"it serves Hopper \(9.x\)\)"),
    (kernel_checks.CUDA_DEVICE_KIND, r"Ampere \(8.x\) GPUs \(compute capability 8.0")],
    ids=["b200", "a100"])
def test_forced_mosaic_gpu_refused_where_it_has_no_kernel(device_kind, match):
  """FRAC's Mosaic GPU kernel is WGMMA's (Hopper): forcing it for a B200 or an A100 is a
  clear error when lowered (auto takes Triton there), not a Mosaic compiler failure."""
  op = functools.partial(kernel.frac_scan, backend="mosaic_gpu")
  with pytest.raises(ValueError, match=f"backend='mosaic_gpu' has no kernel for {match}"):
    kernel_checks.export_mlir(lambda *a: op(*a)[0], "cuda", *_benchmark_shape(BF16),
                              device_kind=device_kind)


@pytest.mark.parametrize("measured, dtype, n, chunk",
                         [(False, BF16, 16, 32), (True, BF16, 16, 64), (True, BF16, 48, 32),
                          (True, F32, 16, 32)],
                         ids=["bf16", "bf16-measured", "bf16-n48", "f32"])
def test_default_chunk_follows_the_kernel_that_runs(measured, dtype, n, chunk):
  """On Hopper the default chunk is Mosaic GPU's 64 only where Mosaic GPU runs the scan
  (once measured faster: `dispatch.MEASURED_FASTER`); where it cannot (N > 32), is not
  picked (float32) or is not yet measured, Triton runs with its 32 (64-token chunks spill
  its registers)."""
  from neurips26_jax.pallas_kernels.dispatch import target_chip
  x, b = jnp.zeros((1, 333, 4, 64), dtype), jnp.zeros((1, 333, 4, n), dtype)
  with (kernel_checks.measured_faster("frac_scan") if measured else contextlib.nullcontext(),
        target_chip("gpu-h100")):
    assert kernel._plan(x, b, jnp.zeros((4, 16)), None, None).chunk == chunk


@pytest.mark.parametrize("name, value", [("m_block", 3), ("p_block", 24)])
def test_block_sizes_must_split_evenly(name, value):
  inputs, _, _ = _case(SHORT)
  args = tuple(cast(a, t) for a, t in zip(inputs, DTYPES[F32], strict=True))
  with pytest.raises(ValueError, match=f"`{name}` must be a power of two .* got {value}"):
    kernel.frac_scan(*args[:6], **{name: value})
