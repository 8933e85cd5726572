"""Pack3D attention's Mosaic GPU body (Hopper) through its interpreter on CPU, races checked:
forward and gradients against the independent float64 loop of `tests/independent.py`, and
which body `backend=None` picks per chip, dtype and cube size.

The body needs cubes of 33 to 64 tokens (T = 64 slots: WGMMA's M), so this file has its own
layout with (4, 3, 4) cubes: 48 tokens, 16 slots of every cube always empty. Inputs are
random (never zeros), field sizes odd; the reference sees q and k as given (already rotated,
the op's contract), in bf16 the bf16-rounded inputs. Gradients: directional derivatives
(`tests/independent_checks.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.pallas_kernels import pack3d_attention as pack_kernel
from tests import independent as ind
from tests import kernel_checks
from tests.independent_checks import cast, check, check_directional, rounded
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu
from tests.test_pack3d import packed

pytestmark = needs_mosaic_gpu

F32, BF16 = jnp.float32, jnp.bfloat16
BLOCK = (4, 3, 4)
H = 2
# Entry 0: one (9, 3, 3) field, 3 x 1 x 1 partial cubes (cube 2 along z is far from 0);
# entry 1: a (9, 2, 3) field (far cubes along z) and a (3, 3, 3) one. N = 81, shuffled.
# Few cubes: the interpreter's cost is per program of the grid (cube, head, batch entry).
COORDS, FIELDS = packed(([(9, 3, 3)], [(9, 2, 3), (3, 3, 3)]))


def _sparse():
  """One batch entry of 75 tokens, one per cube (a 5 x 5 x 3 grid of cubes, shuffled): 63
  slots of every cube empty, and more cubes than one block of 64 summaries holds."""
  cubes = np.stack(np.meshgrid(*[np.arange(n) for n in (5, 5, 3)], indexing="ij"), -1)
  coords = cubes.reshape(-1, 3) * np.asarray(BLOCK) + np.array([1, 2, 0])
  coords = coords[np.random.default_rng(7).permutation(len(coords))]
  return coords[None].astype(np.int32), np.zeros((1, len(coords)), np.int32)


LAYOUTS = {"fields": (COORDS, FIELDS), "sparse": _sparse()}
OFFSET = np.array([0.6, -0.9])
CASES = {"default": {}, "radius0": {"radius_blocks": 0}, "radius2": {"radius_blocks": 2},
         "no_bias": {"block_bias": False}}
# Measured over the cases below: f32 forward <= 5.2e-7, gradients <= 6.6e-7; bf16 forward
# <= 2.6e-3 (the bf16 output's own rounding is up to 2e-3), gradients <= 3.9e-3 (the
# probabilities and score gradients enter WGMMA rounded to bf16).
TOL = {F32: 1e-5, BF16: 6e-3}
GRAD_TOL = {F32: 1e-5, BF16: 1e-2}


@functools.lru_cache(maxsize=None)
def inputs(d: int, layout: str):
  """q, k, v [B, N, H, D], a cotangent W and one direction per input (and the offset)."""
  rng = np.random.default_rng(d)
  shape = LAYOUTS[layout][0].shape[:2] + (H, d)
  q, k, v, w, *dirs = (rng.standard_normal(shape) for _ in range(7))
  return (q, k, v), w, (*dirs, rng.standard_normal(H))


def reference(q, k, v, beta, case, layout):
  return ind.pack3d_attention(q, k, v, *LAYOUTS[layout], block_shape=BLOCK, far_offset=beta,
                              **CASES[case])


def run(dtype, d: int, case: str, offset: bool, layout: str):
  """The op's output and its VJP (cotangent W) in q, k, v (and far_offset)."""
  (q, k, v), w, _ = inputs(d, layout)
  args = tuple(cast(a, dtype) for a in (q, k, v)) + ((cast(OFFSET, F32),) if offset else ())

  def fn(q, k, v, *beta):
    return pack_kernel.pack3d_attention(
        q, k, v, *LAYOUTS[layout], block_shape=BLOCK, far_offset=beta[0] if beta else None,
        backend="mosaic_gpu", interpret=mosaic_gpu_interpreter(), **CASES[case])

  out, vjp = jax.vjp(fn, *args)
  return out, vjp(cast(w, dtype))


def check_case(dtype, d: int, case: str, offset: bool, layout: str = "fields"):
  (q, k, v), w, dirs = inputs(d, layout)
  beta = OFFSET if offset else None
  if dtype == BF16:
    q, k, v = (rounded(a, dtype) for a in (q, k, v))
  w = rounded(w, dtype)
  out, grads = run(dtype, d, case, offset, layout)
  assert out.dtype == dtype
  ref = lambda q, k, v, beta: reference(q, k, v, beta, case, layout)
  check(out, ref(q, k, v, beta), rtol=TOL[dtype], name=f"{case} out")
  primals = (q, k, v) + ((beta,) if offset else ())
  loss = lambda *a: float(np.sum(w * ref(*a[:3], a[3] if offset else None)))
  derivs = [ind.directional_derivative(loss, primals, i, dirs[i]) for i in range(len(primals))]
  names = ["q", "k", "v", "far_offset"][:len(primals)]
  check_directional(grads, derivs, dirs[:len(primals)], rtol=GRAD_TOL[dtype], name=names)


def test_forward_and_grads_far_offset_f32():
  """D = 24 (padded to 32 for WGMMA), a far offset: o, dq, dk, dv and d far_offset."""
  check_case(F32, 24, "default", True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, case, offset", [
    (24, "default", False), (48, "default", True), (32, "radius0", False),
    (24, "radius2", True), (48, "no_bias", False)])
def test_forward_and_grads(dtype, d, case, offset):
  check_case(dtype, d, case, offset)


@pytest.mark.slow
def test_two_summary_blocks():
  """75 cubes of one token each: the far stream walks two blocks of 64 summaries (the
  second one partly padding), the summary kernel runs two programs per head."""
  check_case(F32, 16, "default", True, layout="sparse")


def _custom_calls(device_kind: str, dtype, block_shape=BLOCK, d=32, **blocks):
  """(Mosaic GPU, Triton) custom calls in the gradient of `backend=None` lowered for a GPU.
  The coords are traced (max_cubes slots, as in the models): concrete ones would build the
  layout eagerly, recompiling its ops after every `measured_faster` cache clear."""
  spec = jax.ShapeDtypeStruct((2, COORDS.shape[1], H, d), dtype)
  op = lambda q, k, v, c, f: pack_kernel.pack3d_attention(q, k, v, c, f, block_shape=block_shape,
                                                          max_cubes=8, **blocks)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, op), argnums=(0, 1, 2))
  text = kernel_checks.export_mlir(grad, "cuda", spec, spec, spec,
                                   jax.ShapeDtypeStruct(COORDS.shape, jnp.int32),
                                   jax.ShapeDtypeStruct(FIELDS.shape, jnp.int32),
                                   device_kind=device_kind)
  return tuple(text.count(kernel_checks.BACKEND_CALL[b]) for b in ("mosaic_gpu", "triton"))


HOPPER, AMPERE = kernel_checks.HOPPER_DEVICE_KIND, kernel_checks.CUDA_DEVICE_KIND
BLACKWELL = kernel_checks.BLACKWELL_DEVICE_KIND


def test_auto_takes_triton_on_hopper_until_mosaic_gpu_is_measured():
  """backend=None runs Triton on an H100 for bf16: the Mosaic GPU body has run on no chip
  (`dispatch.MEASURED_FASTER`), so it is selectable but not the default."""
  assert _custom_calls(HOPPER, BF16) == (0, 4)


@pytest.mark.parametrize("device_kind, dtype, options, calls", [
    (HOPPER, BF16, {}, (4, 0)),                                  # forward, dq, dK/dV, summaries
    (AMPERE, BF16, {}, (0, 4)),                                  # Ampere: Triton
    (BLACKWELL, BF16, {}, (0, 4)),                               # B200: Triton (WGMMA kernel)
    (HOPPER, F32, {}, (0, 4)),                                   # float32: Triton
    (HOPPER, BF16, {"block_shape": (2, 2, 2)}, (0, 4)),          # 8-token cubes: Triton
    (HOPPER, BF16, {"d": 264}, (0, 4)),                          # D > 256: Triton
    (HOPPER, BF16, {"block_summaries": 32}, (0, 4)),             # not WGMMA rows: Triton
], ids=["h100", "a100", "b200", "h100-f32", "h100-small-cubes", "h100-wide-heads", "h100-blocks32"])
def test_once_measured_auto_picks_mosaic_gpu_on_hopper_for_bf16_and_64_slot_cubes(
    device_kind, dtype, options, calls):
  with kernel_checks.measured_faster("pack3d_attention"):
    assert _custom_calls(device_kind, dtype, **options) == calls


@pytest.mark.parametrize("side, d, options, match", [
    (2, 16, {"block_shape": (2, 2, 2)}, r"needs `block_shape` of 33 to 64"),
    (4, 264, {}, r"needs the head width D .* <= 256, got 264"),
    (4, 16, {"block_summaries": 32}, r"needs `block_summaries` a multiple of 64, got 32"),
], ids=["cubes", "head-width", "summary-blocks"])
def test_forced_mosaic_gpu_names_what_it_cannot_tile(side, d, options, match):
  """A forced backend='mosaic_gpu' on a call its body cannot tile is a one-line error naming
  the argument (backend=None runs Triton there: the dispatch test above)."""
  q = jnp.ones((1, side ** 3, 1, d), BF16)
  coords = jnp.asarray(np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1)
                       .reshape(1, side ** 3, 3), jnp.int32)
  with pytest.raises(ValueError, match="backend='mosaic_gpu' " + match):
    pack_kernel.pack3d_attention(q, q, q, coords, jnp.zeros((1, side ** 3), jnp.int32),
                                 backend="mosaic_gpu", **options)
