"""FlashFFN's Mosaic GPU kernels on Blackwell (tcgen05 MMAs into tensor memory, traced for a
B200 with `target_chip`): forward and every gradient against the independent float64
reference of `tests/independent.py` through the Mosaic GPU interpreter with its race
detector (odd sizes, random inputs), bf16 (what dispatch runs on a B200) and float32, other
shapes and the two-pass dK/dU/dV kernel in the slow run; the tensor-memory ordering the
interpreter cannot check, in the traced kernels; `backend=None` lowers to Mosaic GPU for a B200
target with 16-bit inputs (Triton for float32 and wide heads); Blackwell's tile rules and
the refusals of a forced Mosaic GPU kernel. How outputs and gradients are compared:
`tests/independent_checks.py`."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.pallas_kernels import flash_ffn as kernel
from neurips26_jax.pallas_kernels import dispatch
from neurips26_jax.pallas_kernels.dispatch import target_chip
from neurips26_jax.pallas_kernels.flash_ffn import mosaic_gpu as blackwell_kernels
from tests import independent as ind
from tests import kernel_checks
from tests import test_flash_ffn as hopper
from tests.independent_checks import as_f64, cast, check, check_directional
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu
from tests.test_flash_ffn_independent import (FFN_DIRS, FFN_INPUTS, FFN_NAMES, FFN_W,
                                              _ffn_args, ffn_reference_derivatives)

pytestmark = needs_mosaic_gpu
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
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


@pytest.mark.slow  # the same body as bf16's (run by default), 16 s in its interpreter
def test_forward_and_grads_f32():
  check_against_independent(F32)


def test_forward_and_grads_bf16():
  """The dtype dispatch runs on a B200 (float32 takes Triton there)."""
  check_against_independent(BF16)


# dK/dU/dV in two passes over the tokens: 3 * 48 + 3 * 128 = 528 tensor-memory columns > 512
# (`test_dkuv_passes`); two 128-token steps.
TWO_PASSES = dict(shape=(1, 200, 1, 48, 2, 40), block_q_dkv=128)


@pytest.mark.parametrize("d, bk, passes", [(128, 32, 1), (96, 64, 1), (128, 64, 2), (48, 128, 2)])
def test_dkuv_passes(d, bk, passes):
  """One pass while three [128, d] accumulators and three [128, bk] products fit tensor
  memory's 512 columns (Pallas' sum of 8-column-rounded buffers), else two: 96 and 64 fit
  (480 columns) although each rounded to a power of two would not."""
  with target_chip(CHIP):
    assert len(blackwell_kernels._dkuv_passes(128, d, bk)) == passes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_two_dkuv_passes(dtype, monkeypatch):
  """The two-pass dK/dU/dV kernel (dK and dU, then dV) against the einsum reference."""
  shape, bk = TWO_PASSES["shape"], TWO_PASSES["block_q_dkv"]
  with target_chip(CHIP):
    assert len(blackwell_kernels._dkuv_passes(128, shape[3], bk)) == 2
  monkeypatch.setitem(hopper.PATHS, "mosaic_gpu_blackwell",
                      functools.partial(blackwell_op(), block_q_dkv=bk))
  hopper.compiled.cache_clear()
  with target_chip(CHIP):
    hopper.check_against_reference("mosaic_gpu_blackwell", dtype, shape=shape)
  hopper.compiled.cache_clear()


def _eqn_lists(jaxpr):
  """The equation lists of `jaxpr` and of every jaxpr nested in its equations' parameters
  (the kernels' bodies, scopes and loops)."""
  yield jaxpr.eqns
  stack = [v for e in jaxpr.eqns for v in e.params.values()]
  while stack:
    value = stack.pop()
    if isinstance(value, (tuple, list)):
      stack.extend(value)
    elif isinstance(value, jax.extend.core.ClosedJaxpr):
      yield from _eqn_lists(value.jaxpr)
    elif isinstance(value, jax.extend.core.Jaxpr):
      yield from _eqn_lists(value)


def test_tensor_memory_loads_ordered_before_the_next_mma():
  """After the loads from tensor memory, every thread fences and signals on a barrier that
  orders the tensor core (arrive, then wait) before one thread issues the next MMA into the
  same columns. The interpreter runs in program order and cannot see a missing fence, so
  this checks the traced kernels' structure (the PTX it gives: `tcgen05.fence::*_thread_sync`
  around each `tcgen05.wait::ld`)."""
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, blackwell_op()), argnums=(0,))
  args = hopper.make_inputs(BF16, shape=(1, 9, 1, 16, 1, 64))
  with target_chip(CHIP):
    jaxpr = jax.make_jaxpr(grad)(*args).jaxpr
  loads = 0
  for eqns in _eqn_lists(jaxpr):
    names = [e.primitive.name for e in eqns]
    for i, name in enumerate(names):
      if name == "wait_load_tmem":
        loads += 1
        assert names[i + 1:i + 3] == ["barrier_arrive", "barrier_wait"], names[i:i + 3]
        assert eqns[i + 1].invars[0].aval.inner_aval.dtype.orders_tensor_core
  assert loads >= 3  # forward, dq/dr and dK/dU/dV kernels


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


@pytest.mark.parametrize("measured, dtype, backend",
                         [(False, BF16, "triton"), (True, BF16, "mosaic_gpu"),
                          (True, F16, "mosaic_gpu"), (True, F32, "triton")],
                         ids=["bf16", "bf16-measured", "f16-measured", "f32-measured"])
def test_auto_picks_mosaic_gpu_on_blackwell_once_measured(measured, dtype, backend):
  """backend=None lowers to Triton for a B200 while the tcgen05 body has run on no chip
  (`dispatch.MEASURED_FASTER`). Once measured faster there: Mosaic GPU (the mosaic_gpu_v2
  custom call) for 16-bit inputs (float16 with bfloat16's 128-row tiles) and Triton for
  float32 (forward: one kernel; gradient: three)."""
  args = hopper.paper_shape(dtype)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, kernel.mhffn),
                  argnums=(0, 1, 2, 3, 4))
  other = {"mosaic_gpu": "triton", "triton": "mosaic_gpu"}[backend]
  with kernel_checks.measured_faster("mhffn") if measured else contextlib.nullcontext():
    texts = [kernel_checks.export_mlir(fn, "cuda", *args,
                                       device_kind=kernel_checks.BLACKWELL_DEVICE_KIND)
             for fn in (kernel.mhffn, grad)]
  for text, count in zip(texts, (1, 3)):
    assert text.count(kernel_checks.BACKEND_CALL[backend]) == count
    assert kernel_checks.BACKEND_CALL[other] not in text


def test_auto_takes_triton_on_blackwell_for_wide_heads():
  """d_h > 128 (here 192): the Blackwell dK/dU/dV kernel's tiles would not fit shared
  memory, so backend=None lowers to Triton for a B200 even once its body is measured (Mosaic
  GPU on Hopper)."""
  spec = lambda *s, d=BF16: jax.ShapeDtypeStruct(s, d)
  args = (spec(1, 256, 2, 192), spec(1, 256, 2, 2, d=F32), *(spec(2, 2, 128, 192),) * 3)
  with kernel_checks.measured_faster("mhffn"):
    for device_kind, backend in ((kernel_checks.BLACKWELL_DEVICE_KIND, "triton"),
                                 (kernel_checks.HOPPER_DEVICE_KIND, "mosaic_gpu")):
      text = kernel_checks.export_mlir(kernel.mhffn, "cuda", *args, device_kind=device_kind)
      assert kernel_checks.BACKEND_CALL[backend] in text, device_kind


def test_auto_takes_triton_on_hopper_beyond_its_widest_head():
  """d_h = 264 > 256 (WGMMA's widest N): backend=None lowers to Triton for an H100 instead of
  refusing the shape in the Mosaic GPU tile plan."""
  spec = lambda *s, d=BF16: jax.ShapeDtypeStruct(s, d)
  args = (spec(1, 256, 1, 264), spec(1, 256, 1, 2, d=F32), *(spec(1, 2, 64, 264),) * 3)
  text = kernel_checks.export_mlir(kernel.mhffn, "cuda", *args,
                                   device_kind=kernel_checks.HOPPER_DEVICE_KIND)
  assert kernel_checks.BACKEND_CALL["triton"] in text
  assert kernel_checks.BACKEND_CALL["mosaic_gpu"] not in text


@pytest.mark.parametrize("dtype, match", [
    (BF16, "needs d_h <= 128 on Blackwell, got 192"),
    (F32, r"16-bit inputs only \(its float32 kernels fault on a real GPU")], ids=["d_h", "f32"])
def test_forced_mosaic_gpu_on_blackwell_names_the_limit(dtype, match):
  """A forced backend='mosaic_gpu' compiled for a B200 names what it does not serve: the head
  width (not "no kernel for compute capability 10.0": the Blackwell kernel exists), or float32
  (without calling the B200 a Hopper GPU)."""
  spec = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  args = (spec(1, 256, 1, 192), spec(1, 256, 1, 2, d=F32), *(spec(1, 2, 128, 192),) * 3)
  op = functools.partial(kernel.mhffn, backend="mosaic_gpu")
  with pytest.raises(ValueError, match=match):
    kernel_checks.export_mlir(op, "cuda", *args, device_kind=kernel_checks.BLACKWELL_DEVICE_KIND)


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
  for dtype, entry in (("float32", "float32"), ("bfloat16", "bfloat16"),
                       ("float16", "bfloat16")):
    assert (kernel.BlockSizes.for_backend("mosaic_gpu", dtype)
            == kernel.TUNED["mosaic_gpu", CHIP, entry])


def test_gpu_benchmark_checks_what_auto_runs():
  """benchmarks/gpu_flash_ffn.py checks and times both kernel bodies on a B200 (the tcgen05
  one too, which backend=None does not pick until it is measured there)."""
  from benchmarks import gpu_flash_ffn as bench
  with target_chip(CHIP):
    assert bench.gpu_backends() == ("triton", "mosaic_gpu")
    assert bench.auto_backend() == bench.auto_backend(F32) == "triton"
