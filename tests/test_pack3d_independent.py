"""Pack3D attention against the independent float64 references of `tests/independent.py`: a
loop over query tokens with relative rotations R(p_j - p_i). Every path (XLA, traced coords,
Mosaic and Triton bodies), forward and gradients (by central differences), the radius and
bias options, bf16, the learnable far offset, and the project's axial RoPE feeding the XLA
path.

Inputs are random (never zeros), sizes odd, and every bf16 reference is evaluated on the
bf16-rounded inputs (so only the op's own rounding counts). The f32 tolerances are ~40x
above the measured errors, the bf16 ones 2-4x (the numbers are in the comments next to
them); how outputs and gradients are compared: `tests/independent_checks.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import pack3d as pack_ops
from neurips26_jax.jaxops import rope as rope_ops
from neurips26_jax.pallas_kernels import pack3d_attention as pack_kernel
from tests import independent as ind
from tests.independent_checks import cast, check, check_directional, params, rounded

F32, BF16 = jnp.float32, jnp.bfloat16


BLOCK = (2, 3, 2)  # non-cubic cube
PACK_H, PACK_D = 2, 12
PACK_ROPE = (10000.0, (1.0, 1.0, 1.0))


def _grid(shape):
  return np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"),
                  -1).reshape(-1, 3)


def _pack_layout():
  """Two batch entries of 65 tokens each, every token order shuffled (fields interleaved).

  Entry 0: field 0 is a (7, 3, 4) grid (partial cubes on z and x) with one whole cube
  removed (an empty interior cube) and 8 more random tokens dropped; field 1 is a single
  token. Its cubes lie up to 3 apart along z, so radius 0, 1 and 2 all differ.
  Entry 1: one (5, 13, 1) field (partial cubes on every axis), 5 cubes along y.
  """
  rng = np.random.default_rng(3)
  a = _grid((7, 3, 4))
  a = a[~np.all(a // np.asarray(BLOCK) == (1, 0, 1), axis=1)]  # empty the cube (1, 0, 1)
  a = a[np.sort(rng.choice(len(a), 64, replace=False))]
  coords0 = np.concatenate([a, [[0, 0, 0]]])
  fields0 = np.array([0] * 64 + [1])
  coords1, fields1 = _grid((5, 13, 1)), np.zeros(65, int)
  p0, p1 = rng.permutation(65), rng.permutation(65)
  coords = np.stack([coords0[p0], coords1[p1]]).astype(np.int32)
  fields = np.stack([fields0[p0], fields1[p1]]).astype(np.int32)
  return coords, fields


PACK_COORDS, PACK_FIELDS = _pack_layout()
PACK_MAX_CUBES = ind.count_cubes(PACK_COORDS, PACK_FIELDS, BLOCK) + 3


def _pack_raw_inputs():
  """Un-rotated q, k, v [2, 65, H, D]; cotangent W; one random direction per input."""
  rng = np.random.default_rng(4)
  q, k, v, w, dq, dk, dv = (rng.standard_normal((2, 65, PACK_H, PACK_D)) for _ in range(7))
  return (q, k, v), w, (dq, dk, dv)


PACK_RAW, PACK_W, PACK_DIRS = _pack_raw_inputs()
# The project's inputs are q and k rotated (by this file's own RoPE, in float64).
PACK_ROT = tuple(ind.axial_rope_3d(a, PACK_COORDS, theta=PACK_ROPE[0], spacing=PACK_ROPE[1])
                 for a in PACK_RAW[:2]) + (PACK_RAW[2],)
PACK_ROT_DIRS = tuple(ind.axial_rope_3d(a, PACK_COORDS, theta=PACK_ROPE[0],
                                        spacing=PACK_ROPE[1])
                      for a in PACK_DIRS[:2]) + (PACK_DIRS[2],)

PACK_CASES = {  # name: keyword arguments beyond block_shape (default radius 1, bias on)
    "default": {},
    "radius0": {"radius_blocks": 0},
    "radius2": {"radius_blocks": 2},
    "no_bias": {"block_bias": False},
}
PACK_PATHS = {
    "xla": functools.partial(pack_ops.pack3d_attention, block_shape=BLOCK, chunk=3),
    "xla_traced": functools.partial(pack_ops.pack3d_attention, block_shape=BLOCK,
                                    max_cubes=PACK_MAX_CUBES),
    "mosaic": functools.partial(pack_kernel.pack3d_attention, block_shape=BLOCK,
                                backend="mosaic", interpret=True, block_summaries=8),
    "triton": functools.partial(pack_kernel.pack3d_attention, block_shape=BLOCK,
                                backend="triton", interpret=True, block_summaries=8),
}
# Measured, every path: f32 forward <= 1.8e-7, gradients <= 2.5e-7; bf16 forward <= 1.1e-3
# (reference on the rounded inputs; the op's bf16 matmuls and its bf16 output remain).
PACK_TOL = {F32: 1e-5, BF16: 4e-3}
PACK_GRAD_TOL = {F32: 1e-5}


def _pack_reference_raw(q, k, v, case):
  """The reference on UN-rotated q, k: every logit from R(p_j - p_i)."""
  return ind.pack3d_attention(q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                              rope=PACK_ROPE, **PACK_CASES[case])


@functools.lru_cache(maxsize=None)
def pack_reference(case, dtype):
  if dtype == F32:  # relative rotations on the raw inputs
    return _pack_reference_raw(*PACK_RAW, case)
  # bf16: the op sees the rotated inputs rounded to bf16; no rotation left to do.
  q, k, v = (rounded(a, dtype) for a in PACK_ROT)
  return ind.pack3d_attention(q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                              **PACK_CASES[case])


@functools.lru_cache(maxsize=None)
def pack_reference_derivatives(case):
  """d/de sum(W * ref(X + e dX)) for X = q, k, v (raw space), float64 central differences."""
  loss = lambda q, k, v: float(np.sum(PACK_W * _pack_reference_raw(q, k, v, case)))
  return tuple(ind.directional_derivative(loss, PACK_RAW, i, PACK_DIRS[i])
               for i in range(3))


@functools.lru_cache(maxsize=None)
def pack_run(path, case, dtype, grads):
  """The project's output (and its VJP with cotangent W) on the rotated inputs."""
  op = functools.partial(PACK_PATHS[path], **PACK_CASES[case])
  args = tuple(cast(a, dtype) for a in PACK_ROT)
  w = cast(PACK_W, dtype)

  def run(q, k, v, coords, fields):
    fn = lambda q, k, v: op(q, k, v, coords, fields)
    if not grads:
      return fn(q, k, v), None
    out, vjp = jax.vjp(fn, q, k, v)
    return out, vjp(w)

  if path == "xla_traced":  # coords and field ids are jit arguments: the max_cubes path
    return jax.jit(run)(*args, jnp.asarray(PACK_COORDS), jnp.asarray(PACK_FIELDS))
  return jax.jit(lambda q, k, v: run(q, k, v, PACK_COORDS, PACK_FIELDS))(*args)


def test_pack3d_reference_self_consistency():
  """The loop's two forms agree: relative rotations on raw q, k == plain dot products on
  q, k rotated per token (R(p_i)^T R(p_j) = R(p_j - p_i)); and a radius covering every cube
  is full attention within each field."""
  relative = pack_reference("default", F32)
  absolute = ind.pack3d_attention(*PACK_ROT, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK)
  np.testing.assert_allclose(relative, absolute, atol=1e-12)
  every = ind.pack3d_attention(*PACK_RAW, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                               radius_blocks=20, rope=PACK_ROPE)
  full = ind.field_attention(*PACK_RAW, PACK_COORDS, PACK_FIELDS, rope=PACK_ROPE)
  np.testing.assert_allclose(every, full, atol=1e-12)
  # The radius and the bias matter on this layout (else their tests could not fail).
  for case in ("radius0", "radius2", "no_bias"):
    assert np.max(np.abs(pack_reference(case, F32) - relative)) > 1e-2, case
  assert np.max(np.abs(pack_reference("radius2", F32) - full)) > 1e-2


# Kernels slow: test_pack3d_far_offset_forward_and_grads[mosaic/triton-default] holds them to
# this reference in every gradient, test_pack3d.py's kernel tests without the offset operand.
@pytest.mark.parametrize("path", params(PACK_PATHS, fast=("xla",)))
def test_pack3d_forward_and_grads(path):
  """Default options, f32: forward and dq, dk, dv against the loop with relative rotations."""
  out, grads = pack_run(path, "default", F32, True)
  check(out, pack_reference("default", F32), rtol=PACK_TOL[F32], name=f"{path} out")
  check_directional(grads, pack_reference_derivatives("default"), PACK_ROT_DIRS,
                    rtol=PACK_GRAD_TOL[F32], name="qkv")


@pytest.mark.parametrize("path,case", [
    pytest.param(path, case, id=f"{path}-{case}",
                 marks=() if path == "xla" or (path, case) == ("xla_traced", "radius2")
                 else pytest.mark.slow)
    for path in PACK_PATHS for case in ("radius0", "radius2", "no_bias")])
def test_pack3d_options_forward(path, case):
  """radius_blocks 0 and 2 and block_bias=False, f32 forward, every path."""
  out, _ = pack_run(path, case, F32, False)
  check(out, pack_reference(case, F32), rtol=PACK_TOL[F32], name=f"{path} {case}")


@pytest.mark.parametrize("path", params(PACK_PATHS, fast=("xla",)))
def test_pack3d_bf16_forward(path):
  out, _ = pack_run(path, "default", BF16, False)
  assert out.dtype == BF16
  check(out, pack_reference("default", BF16), rtol=PACK_TOL[BF16], name=f"{path} bf16")


# The learnable far offset beta_h (`far_offset`): one value per head, of either sign, and a
# random direction for its directional derivative.
PACK_OFFSET = np.array([0.8, -1.1])
PACK_OFFSET_DIR = np.random.default_rng(5).standard_normal(PACK_H)
OFFSET_PATHS = {"reference": functools.partial(pack_ops.pack3d_attention_reference,
                                               block_shape=BLOCK), **PACK_PATHS}
OFFSET_CASES = ("default", "no_bias")  # with block_bias=False the offset is added to 0


def _offset_reference_raw(q, k, v, beta, case):
  return ind.pack3d_attention(q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                              rope=PACK_ROPE, far_offset=beta, **PACK_CASES[case])


@functools.lru_cache(maxsize=None)
def offset_reference(case, dtype):
  if dtype == F32:
    return _offset_reference_raw(*PACK_RAW, PACK_OFFSET, case)
  q, k, v = (rounded(a, dtype) for a in PACK_ROT)
  return ind.pack3d_attention(q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                              far_offset=PACK_OFFSET, **PACK_CASES[case])


@functools.lru_cache(maxsize=None)
def offset_reference_derivatives(case):
  """d/de sum(W * ref(X + e dX)) for X = q, k, v (raw space) and beta, float64."""
  loss = lambda q, k, v, beta: float(np.sum(PACK_W * _offset_reference_raw(q, k, v, beta, case)))
  args = (*PACK_RAW, PACK_OFFSET)
  return tuple(ind.directional_derivative(loss, args, i, d)
               for i, d in enumerate((*PACK_DIRS, PACK_OFFSET_DIR)))


@functools.lru_cache(maxsize=None)
def offset_run(path, case, dtype, grads):
  """The project's output with far_offset (float32 beta, as the layer passes it) and its VJP
  in q, k, v and beta with cotangent W."""
  op = functools.partial(OFFSET_PATHS[path], **PACK_CASES[case])
  args = tuple(cast(a, dtype) for a in PACK_ROT) + (cast(PACK_OFFSET, F32),)
  w = cast(PACK_W, dtype)

  def run(q, k, v, beta, coords, fields):
    fn = lambda q, k, v, beta: op(q, k, v, coords, fields, far_offset=beta)
    if not grads:
      return fn(q, k, v, beta), None
    out, vjp = jax.vjp(fn, q, k, v, beta)
    return out, vjp(w)

  if path == "xla_traced":
    return jax.jit(run)(*args, jnp.asarray(PACK_COORDS), jnp.asarray(PACK_FIELDS))
  return jax.jit(lambda q, k, v, beta: run(q, k, v, beta, PACK_COORDS, PACK_FIELDS))(*args)


def test_pack3d_far_offset_reference_self_consistency():
  """The offset matters on this layout (with and without the log(n_b) bias), beta = 0 is the
  loop without it, and beta_h acts on head h alone."""
  for case in OFFSET_CASES:
    assert np.max(np.abs(offset_reference(case, F32) - pack_reference(case, F32))) > 1e-2
  zero = _offset_reference_raw(*PACK_RAW, np.zeros(PACK_H), "default")
  np.testing.assert_array_equal(zero, pack_reference("default", F32))
  head0 = _offset_reference_raw(*PACK_RAW, np.array([PACK_OFFSET[0], 0.0]), "default")
  np.testing.assert_array_equal(head0[:, :, 1], zero[:, :, 1])
  np.testing.assert_array_equal(head0[:, :, 0], offset_reference("default", F32)[:, :, 0])


@pytest.mark.parametrize("path,case", [
    pytest.param(path, case, id=f"{path}-{case}",
                 marks=() if (case == "default" and path != "xla_traced")
                 or (path, case) == ("xla", "no_bias") else pytest.mark.slow)
    for path in OFFSET_PATHS for case in OFFSET_CASES])
def test_pack3d_far_offset_forward_and_grads(path, case):
  """A nonzero per-head far offset, f32: forward and dq, dk, dv, d far_offset (the sum of the
  far logits' cotangent per head) against the loop. Measured, every path and both cases:
  forward <= 2.8e-7, gradients <= 5.8e-7 (d far_offset <= 5.8e-7)."""
  out, grads = offset_run(path, case, F32, True)
  check(out, offset_reference(case, F32), rtol=PACK_TOL[F32], name=f"{path} out")
  assert grads[3].shape == (PACK_H,) and grads[3].dtype == F32
  check_directional(grads, offset_reference_derivatives(case),
                    (*PACK_ROT_DIRS, PACK_OFFSET_DIR), rtol=PACK_GRAD_TOL[F32],
                    name=["q", "k", "v", "far_offset"])


@pytest.mark.parametrize("path", params(OFFSET_PATHS, fast=("xla",)))
def test_pack3d_far_offset_bf16_forward(path):
  """bf16 q, k, v with a float32 offset (as the layer passes it): measured <= 1.0e-3."""
  out, _ = offset_run(path, "default", BF16, False)
  assert out.dtype == BF16
  check(out, offset_reference("default", BF16), rtol=PACK_TOL[BF16], name=f"{path} bf16")


def test_pack3d_with_project_rope_end_to_end():
  """The project's axial RoPE (non-unit spacing) feeding the XLA path == the loop that
  forms R(p_j - p_i) from the same spacing on the un-rotated q, k."""
  rope = (100.0, (1.5, 0.5, 2.0))
  q, k, v = PACK_RAW
  rot = lambda a: rope_ops.axial_rope_3d(cast(a, F32), jnp.asarray(PACK_COORDS),
                                         theta=rope[0], spacing=rope[1])
  got = jax.jit(lambda q, k, v: pack_ops.pack3d_attention(
      q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK, radius_blocks=2))(
          rot(q), rot(k), cast(v, F32))
  expected = ind.pack3d_attention(q, k, v, PACK_COORDS, PACK_FIELDS, block_shape=BLOCK,
                                  radius_blocks=2, rope=rope)
  check(got, expected, rtol=1e-5, name="rope + pack3d")  # measured 2.4e-7
