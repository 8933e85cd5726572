"""FlashFFN: every path (XLA chunks, Mosaic, Triton and Mosaic GPU kernel bodies) against the
reference, the GPU kernel choice per chip, bad input and the layers (FlashFFN's and SwiGLU's
formulas and initialisations against float64 numpy, tests/layer_formula_checks.py). The
properties every kernel shares (determinism, lowering, races, bf16) are in
tests/test_kernel_properties.py."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.jaxops import flash_ffn as ops
from neurips26_jax.jaxops.rms_norm import rms_normalize
from neurips26_jax.models import FlashFFN, SwiGLU
from neurips26_jax.models.flash_ffn import flashffn_param_count, heads_and_router
from neurips26_jax.pallas_kernels import flash_ffn as kernel
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available
from neurips26_jax.pallas_kernels.flash_ffn import tiles
from tests import kernel_checks
from tests.layer_formula_checks import (P, build, close, normal, randomize, rms_norm,
                                         run, sigmoid, silu, stats_match)

# Odd L, several experts, d_e spanning two tiles with a partial one (24 = 16 + 8 padded).
B, L, H, D_H, E, D_E = 2, 77, 2, 16, 2, 24
SMALL_BLOCKS = dict(block_q=32, block_inter=16, block_q_dkv=64)
MOSAIC_BLOCKS = dict(block_q=128, block_inter=16, block_q_dkv=128)  # tokens: lanes
# Mosaic GPU: 3 token tiles of 64 (WGMMA's M), d_e = 24 in 16-wide tiles padded to the
# dK/dU/dV kernel's 64 rows (a full, a partial and an empty tile), 32-token dK/dU/dV steps.
MOSAIC_GPU_BLOCKS = dict(block_q=64, block_inter=16, block_q_dkv=32)
MOSAIC_GPU = mosaic_gpu_available()  # jax >= 0.11.2
needs_mosaic_gpu = pytest.mark.skipif(not MOSAIC_GPU, reason="Mosaic GPU needs jax >= 0.11.2")


def mosaic_gpu_interpreter():
  """The Mosaic GPU interpreter with its race detector on (from jax 0.12 it raises at a race:
  a missing barrier wait, an overwritten buffer still being read; 0.11 prints the race)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return plgpu.InterpretGPUParams(detect_races=True)

# Relative to max|reference|. bf16: the XLA path's bound (measured 3.5e-3..1.1e-2); the
# kernels are held to 3x the XLA path's own error on the same inputs (kernel_checks).
TOL = {jnp.float32: 5e-5, jnp.bfloat16: 1.5e-2}

PATHS = {
    "xla": functools.partial(ops.mhffn, chunk=16),
    "mosaic": functools.partial(kernel.mhffn, interpret=True, backend="mosaic", **MOSAIC_BLOCKS),
    "triton": functools.partial(kernel.mhffn, interpret=True, backend="triton", **SMALL_BLOCKS),
}
if MOSAIC_GPU:
  PATHS["mosaic_gpu"] = functools.partial(kernel.mhffn, interpret=mosaic_gpu_interpreter(),
                                          backend="mosaic_gpu", **MOSAIC_GPU_BLOCKS)


def make_inputs(dtype, shape=(B, L, H, D_H, E, D_E), seed=1):
  """Random (q, r, k, u, v), r a softmax over the experts (float32). Drawn with numpy: each
  jax.random call would compile a program per shape, slower than most of the tests here."""
  b, l, h, d_h, e, d_e = shape
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, l, h, d_h), np.float32)
  logits = 2 * rng.standard_normal((b, l, h, e), np.float32)
  r = np.exp(logits - logits.max(axis=-1, keepdims=True))
  r /= r.sum(axis=-1, keepdims=True)
  tables = [0.3 * rng.standard_normal((h, e, d_e, d_h), np.float32) for _ in range(3)]
  return tuple(jax.device_put(a) for a in (q.astype(dtype), r, *(t.astype(dtype) for t in tables)))


def paper_shape(dtype=jnp.bfloat16):
  """Abstract mhffn arguments at the paper's shape (the router float32), for lowering."""
  spec = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  return (spec(1, 1000, 8, 128), spec(1, 1000, 8, 11, d=jnp.float32),
          *(spec(8, 11, 256, 128),) * 3)


@functools.lru_cache(maxsize=None)
def compiled(path: str):
  """jit of (q, r, k, u, v) -> (o, gradients of all five) on `path` or the reference."""
  op = ops.mhffn_reference if path == "reference" else PATHS[path]
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, op), argnums=(0, 1, 2, 3, 4))
  return jax.jit(lambda *a: (op(*a), grad(*a)))


def check_against_reference(path, dtype, shape=(B, L, H, D_H, E, D_E), seed=1):
  """The shared test body: forward and all five gradients of `path` vs the reference."""
  args = make_inputs(dtype, shape, seed)
  if dtype == jnp.bfloat16 and path != "xla":
    kernel_checks.assert_bf16_kernel_close(compiled, path, args,
                                           ["o", "dq", "dr", "dk", "du", "dv"])
    return
  # The reference sees the same (possibly bf16-rounded) inputs, computed in float32.
  out_ref, grads_ref = compiled("reference")(*(a.astype(jnp.float32) for a in args))
  out, grads = compiled(path)(*args)
  assert out.dtype == dtype and out.shape == args[0].shape
  kernel_checks.assert_close(out, out_ref, rtol=TOL[dtype], name="o")
  kernel_checks.assert_grads_close(grads, grads_ref, args, "qrkuv", rtol=TOL[dtype])


def _path_params():
  """(path, dtype) pairs: every path in float32 (Mosaic GPU needs jax >= 0.11.2), the XLA
  path also in bf16 (the kernels' bf16 cases are in tests/test_kernel_properties.py)."""
  for path in ("xla", "mosaic", "triton", "mosaic_gpu"):
    marks = [needs_mosaic_gpu] if path == "mosaic_gpu" else []
    yield pytest.param(path, jnp.float32, id=f"{path}-f32", marks=marks)
  yield pytest.param("xla", jnp.bfloat16, id="xla-bf16")


@pytest.mark.parametrize("path, dtype", list(_path_params()))
def test_matches_reference_forward_and_gradients(path, dtype):
  check_against_reference(path, dtype)


# Mosaic GPU's other layouts and loop shapes: d_h = 128 (flat token layout; its dK/dU/dV
# accumulators take two passes over the tokens), d_h = 24 (padded to a 32-byte row, head-major),
# one expert, one token tile, d_e a multiple of the tile.
MOSAIC_GPU_SHAPES = [(1, 70, 2, 128, 2, 40), (2, 45, 3, 24, 2, 72), (1, 9, 1, 8, 1, 64)]


@pytest.mark.slow
@needs_mosaic_gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", MOSAIC_GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mosaic_gpu_shapes(shape, dtype):
  check_against_reference("mosaic_gpu", dtype, shape=shape)


@pytest.mark.parametrize("d_e, block, itemsize, tile", [
    (264, 256, 2, 144),   # configs/lm_paper.py:370m with FRAC: 288 rows, not 512
    (248, 256, 2, 248), (256, 256, 2, 256), (512, 256, 2, 256), (300, 256, 4, 152),
    (24, 16, 4, 16), (24, 16, 2, 16), (40, 256, 2, 40), (24, 256, 2, 24)])
def test_mosaic_table_tile_pads_less_than_a_tile(d_e, block, itemsize, tile):
  """The TPU kernels' d_e tile: the fewest tiles of at most `block` rows; one tile is d_e in
  whole 8 rows, several start at whole sublanes of the dtype (16 rows for bf16)."""
  got = tiles.mosaic_table_tile(d_e, block, itemsize)
  assert got == tile
  several = -(-d_e // got) > 1
  assert got % (8 * (4 // itemsize) if several else 8) == 0 or got == block
  assert -(-d_e // got) * got - d_e < got


def test_mosaic_uneven_table_tiles(monkeypatch):
  """d_e = 40 with block_inter = 32: two 24-row tiles (48 rows, 8 of them padding)."""
  monkeypatch.setitem(PATHS, "mosaic_uneven", functools.partial(
      kernel.mhffn, interpret=True, backend="mosaic", **dict(MOSAIC_BLOCKS, block_inter=32)))
  check_against_reference("mosaic_uneven", jnp.float32, shape=(1, 21, 2, 16, 2, 40))


def test_mosaic_flat_token_layout():
  """d_h = 128 lets Mosaic read q blocks straight from [T, H * d_h] (no head transpose)."""
  check_against_reference("mosaic", jnp.float32, shape=(1, 21, 2, 128, 2, 16))


# The Mosaic kernels' loop forms: (shape, blocks, VMEM budget or None for the chip's).
MOSAIC_LOOPS = {
    # d_h and block_inter multiples of 128: dK, dU, dV accumulate transposed; d_e = 136
    # in two 128-row tiles, the second partial.
    "transposed-grads": ((1, 37, 2, 128, 2, 136), dict(block_q=128, block_inter=128), None),
    # five d_e tiles per expert: a loop instead of unrolled tiles, with transposed grads
    # (lane-offset slices) and without.
    "tile-loop-transposed": ((1, 21, 1, 128, 2, 640), dict(block_q=128, block_inter=128),
                             None),
    "tile-loop": ((2, 19, 2, 16, 2, 80), dict(block_q=128, block_inter=16), None),
    # a head's tables over the budget: 9 experts in two groups of 8 (the second 1 + 7
    # padding), the forward reducing over groups, the backward's per-group dq summed; one
    # d_e tile per expert (the tile forms are the cases above).
    "expert-groups": ((1, 150, 2, 16, 9, 8), dict(block_q=128, block_inter=8,
                                                   block_q_dkv=128), 1),
}
# d_h = 128 with d_e = 640: the gradients' float32 rounding against the reference (the XLA
# path's too) is 3e-5..1e-4 of their scale, depending on the draw; this one's is within TOL.
LOOP_SEEDS = {"tile-loop-transposed": 2}


@pytest.mark.parametrize("case", list(MOSAIC_LOOPS))
def test_mosaic_loop_forms(case, monkeypatch):
  """Each of the Mosaic kernels' loop forms against the reference (f32, grads included)."""
  shape, blocks, budget = MOSAIC_LOOPS[case]
  if budget is not None:
    monkeypatch.setattr(tiles, "mosaic_vmem_limit", lambda: budget)
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  plan = tiles.TilePlan.make("mosaic", kernel.BlockSizes(**blocks),
                             spec(*shape[:4]), spec(shape[2], *shape[4:], shape[3]))
  assert plan.groups == (2 if case == "expert-groups" else 1)
  name = f"mosaic-{case}"
  monkeypatch.setitem(PATHS, name, functools.partial(kernel.mhffn, interpret=True,
                                                     backend="mosaic", **blocks))
  check_against_reference(name, jnp.float32, shape=shape, seed=LOOP_SEEDS.get(case, 1))


def test_reference_equals_literal_loop():
  """The einsum reference against a per-head, per-expert loop written from DESIGN.md."""
  args = make_inputs(jnp.float32, shape=(1, 9, 2, 8, 2, 8))
  q, r, k, u, v = (np.asarray(a, np.float64) for a in args)
  expected = np.zeros(q.shape)
  for h in range(2):
    for e in range(2):
      a = silu(q[0, :, h] @ k[h, e].T) * (q[0, :, h] @ u[h, e].T)
      expected[0, :, h] += r[0, :, h, e:e + 1] * (a @ v[h, e])
  kernel_checks.assert_close(jax.jit(ops.mhffn_reference)(*args), expected, rtol=1e-5)


def test_default_dispatch_interprets_on_cpu():
  args = make_inputs(jnp.float32, shape=(1, 19, 2, 8, 2, 16))
  kernel_checks.assert_close(kernel.mhffn(*args), jax.jit(ops.mhffn_reference)(*args),
                             rtol=1e-5)


@needs_mosaic_gpu
@pytest.mark.parametrize("device_kind, dtype, backend", [
    (kernel_checks.HOPPER_DEVICE_KIND, jnp.bfloat16, "mosaic_gpu"),
    (kernel_checks.HOPPER_DEVICE_KIND, jnp.float32, "triton"),
    (kernel_checks.CUDA_DEVICE_KIND, jnp.bfloat16, "triton")],
    ids=["h100-bf16", "h100-f32", "a100-bf16"])
def test_auto_picks_the_gpu_kernel_per_chip(device_kind, dtype, backend):
  """backend=None lowers to Mosaic GPU for a Hopper target with bfloat16 inputs and to
  Triton for float32 ones (Mosaic GPU's float32 kernels fault on an H200) and for an Ampere
  target (forward: one kernel; gradient: forward, dq/dr and dK/dU/dV), and to nothing else."""
  args = paper_shape(dtype)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, kernel.mhffn),
                  argnums=(0, 1, 2, 3, 4))
  other = {"mosaic_gpu": "triton", "triton": "mosaic_gpu"}[backend]
  for fn, count in ((kernel.mhffn, 1), (grad, 3)):
    text = kernel_checks.export_mlir(fn, "cuda", *args, device_kind=device_kind)
    assert text.count(kernel_checks.BACKEND_CALL[backend]) == count
    assert kernel_checks.BACKEND_CALL[other] not in text


@needs_mosaic_gpu
def test_auto_picks_mosaic_gpu_for_the_layers_routed_op_on_hopper():
  """The layer's op (`mhffn_routed`, its own entry in `dispatch.MEASURED_FASTER`) runs the
  kernel body measured on an H200, as `mhffn` does: Mosaic GPU for bfloat16 on Hopper."""
  q, r, k, u, v = paper_shape(jnp.bfloat16)
  h, e, d_h = k.shape[0], k.shape[1], k.shape[3]
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  op = lambda q, w_r, k, u, v, g: kernel.mhffn_routed(q, w_r, k, u, v, gain=g)
  text = kernel_checks.export_mlir(op, "cuda", q, spec(h, d_h, e), spec(*k.shape),
                                   spec(*k.shape), spec(*k.shape), spec(h, d_h),
                                   device_kind=kernel_checks.HOPPER_DEVICE_KIND)
  assert kernel_checks.BACKEND_CALL["mosaic_gpu"] in text
  assert kernel_checks.BACKEND_CALL["triton"] not in text


# The warp-specialized kernels (compute_wgs=2; bf16 only): two consumer warpgroups of
# block_q tokens per CTA and a producer streaming table tiles through num_stages slots. The
# first shape's 154 tokens fill 2 CTAs (128 tokens each, one part padding) and walk 8 (e, c)
# steps through 2 slots; d_h = 128 (flat layout) with 3 slots over 4 steps; one step, one slot
# (the last two `slow`: `make test` keeps within its 10 minutes).
WS_CASES = [((B, L, H, D_H, E, D_E), dict(MOSAIC_GPU_BLOCKS)),
            ((1, 70, 2, 128, 2, 40), dict(MOSAIC_GPU_BLOCKS, block_inter=32, num_stages=3)),
            ((1, 9, 1, 8, 1, 64), dict(MOSAIC_GPU_BLOCKS, block_inter=64))]


@needs_mosaic_gpu
@pytest.mark.parametrize("case", [0] + [pytest.param(c, marks=pytest.mark.slow)
                                      for c in range(1, len(WS_CASES))])
def test_mosaic_gpu_warp_specialized_forward(case, monkeypatch):
  """Forward and gradients (all three kernels warp-specialized) against the float32
  reference, races checked."""
  shape, blocks = WS_CASES[case]
  name = f"mosaic_gpu_ws{case}"
  monkeypatch.setitem(PATHS, name, functools.partial(
      kernel.mhffn, interpret=mosaic_gpu_interpreter(), backend="mosaic_gpu", compute_wgs=2,
      **blocks))
  check_against_reference(name, jnp.bfloat16, shape=shape)


@needs_mosaic_gpu
@pytest.mark.parametrize("dtype, blocks, match", [
    (jnp.float32, dict(compute_wgs=2), "`compute_wgs=2` .* needs 16-bit inputs on Hopper"),
    (jnp.bfloat16, dict(compute_wgs=3), "`compute_wgs` must be 1 or 2, got 3"),
    (jnp.bfloat16, dict(compute_wgs=2, num_stages=1), "needs `num_stages` >= 2 .* got 1")])
def test_mosaic_gpu_compute_wgs_errors(dtype, blocks, match):
  with pytest.raises(ValueError, match=match):
    kernel.mhffn(*make_inputs(dtype), interpret=True, backend="mosaic_gpu", **blocks)


def test_warp_specialized_tokens_pad_to_whole_ctas():
  """block_q = 64 with block_q_dkv = 192: the tokens pad to a multiple of both 192 and a
  CTA's 2 x 64 (384), so no token is left out of the forward and dq grids."""
  from neurips26_jax.pallas_kernels.flash_ffn.blocks import BlockSizes
  q = jax.ShapeDtypeStruct((1, 192, 1, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 2, 64, 64), jnp.bfloat16)
  blocks = BlockSizes(block_q=64, block_inter=32, block_q_dkv=192, compute_wgs=2)
  assert tiles.TilePlan.make("mosaic_gpu", blocks, q, k).tokens == 384
  assert tiles.TilePlan.make("mosaic_gpu", dataclasses.replace(blocks, compute_wgs=1),
                             q, k).tokens == 192


@needs_mosaic_gpu
def test_mosaic_gpu_warp_specialized_heads_at_most_128():
  args = make_inputs(jnp.bfloat16, (1, 8, 1, 136, 1, 16))
  with pytest.raises(ValueError, match=r"d_h <= 128 .* got bfloat16, d_h = 136"):
    kernel.mhffn(*args, interpret=True, backend="mosaic_gpu", compute_wgs=2)


@needs_mosaic_gpu
def test_forced_mosaic_gpu_refuses_float32_on_a_gpu():
  """backend='mosaic_gpu' with float32 inputs is a clear error when compiled for a GPU (its
  float32 kernels fault on a real H200); the interpreter still runs them (tests above)."""
  spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  args = (spec(1, 64, 1, 128), spec(1, 64, 1, 2), *(spec(1, 2, 64, 128),) * 3)
  op = functools.partial(kernel.mhffn, backend="mosaic_gpu")
  with pytest.raises(ValueError, match="backend='mosaic_gpu' compiles for 16-bit inputs only"):
    kernel_checks.export_mlir(op, "cuda", *args, device_kind=kernel_checks.HOPPER_DEVICE_KIND)


@pytest.mark.parametrize("op", [ops.mhffn_reference, ops.mhffn, kernel.mhffn],
                         ids=["reference", "xla", "pallas"])
@pytest.mark.parametrize("bad, match", [
    (lambda q, r, k, u, v: (q[0], r, k, u, v), "`q` must have rank 4"),
    (lambda q, r, k, u, v: (q, r, k[:1], u, v), "`k` has shape"),
    (lambda q, r, k, u, v: (q, r, k, u[:, :1], v), "`u` has shape"),
    (lambda q, r, k, u, v: (q, r[..., :1], k, u, v), "`r` has shape"),
    (lambda q, r, k, u, v: (q, r[:, :3], k, u, v), "`r` has shape"),
    (lambda q, r, k, u, v: (q[..., :6], r, k[..., :6], u[..., :6], v[..., :6]), "multiples of 8"),
])
def test_bad_inputs_name_the_argument(op, bad, match):
  with pytest.raises(ValueError, match=match):
    op(*bad(*make_inputs(jnp.float32, shape=(1, 5, 2, 8, 2, 8))))


def test_unknown_block_size_is_an_error():
  with pytest.raises(ValueError, match="block_k"):
    kernel.mhffn(*make_inputs(jnp.float32, shape=(1, 5, 2, 8, 2, 8)), block_k=8)


# ----------------------------------------------------------------------------- layers

D_MODEL, HEADS, EXPERTS, D_EXPERT = 32, 2, 3, 24


def abstract(cls, *args, **kwargs):
  """The layer with its parameters' shapes only (nnx.eval_shape: no initializer runs)."""
  return nnx.eval_shape(lambda: cls(*args, rngs=nnx.Rngs(0), **kwargs))


def param_count(layer):
  return sum(p.size for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def test_layer_parameter_count():
  d, d_ff = D_MODEL, EXPERTS * D_EXPERT
  formula = 2 * d * d + 3 * d * d_ff + d * EXPERTS
  assert flashffn_param_count(d, EXPERTS, D_EXPERT) == formula
  plain = abstract(FlashFFN, D_MODEL, HEADS, EXPERTS, D_EXPERT, head_norm=False)
  assert param_count(plain) == formula
  normed = abstract(FlashFFN, D_MODEL, HEADS, EXPERTS, D_EXPERT)
  assert param_count(normed) == formula + d  # plus the per-head norm gains
  assert param_count(abstract(SwiGLU, D_MODEL, 64)) == 3 * D_MODEL * 64


def test_layer_impls_agree_and_router_is_normalized():
  x = normal(3, (2, 13, D_MODEL)).astype(np.float32)
  layers = {impl: build(FlashFFN, D_MODEL, HEADS, EXPERTS, D_EXPERT, impl=impl)
            for impl in ("pallas", "xla", "reference")}
  outs = {impl: run(layer, x) for impl, layer in layers.items()}
  for impl in ("pallas", "xla"):
    kernel_checks.assert_close(outs[impl], outs["reference"], rtol=1e-5, name=impl)
  layer = layers["xla"]
  q, r = jax.jit(functools.partial(heads_and_router, normalize=True, dtype=jnp.float32))(
      x, layer.w_in[...], layer.router[...])
  assert q.shape == (2, 13, HEADS, D_MODEL // HEADS) and r.dtype == jnp.float32
  np.testing.assert_allclose(np.sum(r, axis=-1), 1.0, rtol=1e-6)


def test_swiglu_has_the_same_signature():
  """Both take [..., d]: FlashFFN folds other ranks to [B, L, d], token by token the same."""
  x = normal(4, (2, 5, D_MODEL)).astype(np.float32)
  swiglu = build(SwiGLU, D_MODEL, 48)
  flash = build(FlashFFN, D_MODEL, HEADS, EXPERTS, D_EXPERT, impl="xla")
  y = run(flash, x)
  assert run(swiglu, x).shape == y.shape == x.shape
  for shaped in (x.reshape(10, D_MODEL), x.reshape(2, 1, 5, D_MODEL), x[0, 0]):
    assert run(swiglu, shaped).shape == shaped.shape
    np.testing.assert_allclose(run(flash, shaped), y.reshape(shaped.shape) if shaped.ndim != 1
                               else y[0, 0], rtol=1e-5, atol=1e-6)


INIT_D, INIT_D_E = 256, 64


@jax.jit
def _rms_pair(graphdef, state, x):
  y, vjp = jax.vjp(nnx.merge(graphdef, state), x)
  dx = vjp(jax.random.normal(jax.random.key(11), y.shape))[0]
  rms = lambda a: jnp.sqrt(jnp.mean(jnp.square(a)))
  return rms(y), rms(dx)


def _rms_and_input_grad_rms(layer):
  """Output RMS and input-gradient RMS (unit-RMS cotangent) on unit-RMS input; one jit for
  every layer, so layers of the same shapes (a FlashFFN's two inits) share its program."""
  x = jax.random.normal(jax.random.key(10), (2, 64, INIT_D))
  return tuple(float(v) for v in _rms_pair(*nnx.split(layer), x))


@functools.cache
def _swiglu_rms(experts):
  """A SwiGLU's RMS pair at the parameter count of FlashFFN(INIT_D, ..., experts, INIT_D_E)
  (the same for every head width)."""
  width = round(flashffn_param_count(INIT_D, experts, INIT_D_E) / (3 * INIT_D))
  return _rms_and_input_grad_rms(SwiGLU(INIT_D, width, rngs=nnx.Rngs(1)))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("experts", [1, 2, 11])
def test_default_init_starts_at_swiglu_scale(head_dim, experts):
  """Output and dx RMS at init within 2x of a SwiGLU of the same d and parameter count; the
  paper's N(0, 0.02) init is far below it (why it is not the default)."""
  d, d_e = INIT_D, INIT_D_E
  flash = FlashFFN(d, d // head_dim, experts, d_e, impl="xla", rngs=nnx.Rngs(0))
  ref = _swiglu_rms(experts)
  got = _rms_and_input_grad_rms(flash)
  for g, r, what in zip(got, ref, ("output", "dx")):
    assert 0.5 < g / r < 2, (what, g, r)
  paper = FlashFFN(d, d // head_dim, experts, d_e, init="paper", impl="xla", rngs=nnx.Rngs(0))
  assert _rms_and_input_grad_rms(paper)[0] < 0.05 * ref[0]


def test_default_shape_matches_the_swiglu_default():
  """FlashFFN(d) has heads of width 128 (not the mixer's), E >= 2, and SwiGLU(d)'s parameter
  count within 2%."""
  for d in (128, 256, 384, 1024):
    flash, swiglu = abstract(FlashFFN, d), abstract(SwiGLU, d)
    assert d // flash.num_heads == 128 and flash.k.shape[1] >= 2
    assert abs(param_count(flash) / param_count(swiglu) - 1) < 0.02, (
        d, param_count(flash), param_count(swiglu))
  assert abstract(FlashFFN, 96).num_heads == 1       # head width 96: all of d
  assert abstract(SwiGLU, 128).w_gate.shape == (128, 344)   # 8/3 d, a multiple of 8


def test_layer_rejects_bad_config():
  with pytest.raises(ValueError, match="impl"):
    FlashFFN(D_MODEL, HEADS, EXPERTS, D_EXPERT, impl="cuda", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_heads"):
    FlashFFN(30, 4, EXPERTS, D_EXPERT, rngs=nnx.Rngs(0))


def _design_formula(x, w_in, norm_gain, router, k, u, v, w_out):
  """DESIGN.md steps 1-5 literally (jitted: op by op, each would compile on its own)."""
  q = (x @ w_in).reshape(*x.shape[:2], HEADS, -1)
  q = q / jnp.sqrt(jnp.mean(q * q, axis=-1, keepdims=True) + 1e-6) * norm_gain
  sig = jax.nn.sigmoid(jnp.einsum("blhd,hde->blhe", q, router))
  r = sig / jnp.sum(sig, axis=-1, keepdims=True)
  o = ops.mhffn_reference(q, r, k, u, v)
  return o.reshape(x.shape) @ w_out


def test_layer_matches_the_design_formula():
  """Folding the norm gain into the tables changes nothing: DESIGN.md steps 1-5 literally."""
  layer = build(FlashFFN, D_MODEL, HEADS, EXPERTS, D_EXPERT, impl="reference")
  layer.norm_gain[...] = jnp.asarray(1 + 0.5 * normal(5, layer.norm_gain.shape), jnp.float32)
  x = normal(6, (2, 9, D_MODEL)).astype(np.float32)
  expected = jax.jit(_design_formula)(
      x, *(p[...] for p in (layer.w_in, layer.norm_gain, layer.router, layer.k, layer.u,
                            layer.v, layer.w_out)))
  kernel_checks.assert_close(run(layer, x), expected, rtol=1e-5)


def test_rms_normalize_gradient_matches_autodiff():
  x = jax.random.normal(jax.random.key(7), (3, 5, 16))
  cot = jax.random.normal(jax.random.key(8), x.shape)
  plain = lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
  kernel_checks.assert_close(rms_normalize(x), plain(x), rtol=1e-6)
  g = jax.vjp(rms_normalize, x)[1](cot)[0]
  g_ref = jax.vjp(plain, x)[1](cot)[0]
  kernel_checks.assert_close(g, g_ref, rtol=1e-5)



def test_group_expansion_forms_agree():
  """The TPU (matmul) and default (repeat) forms of the per-group expansion are the same map;
  the CPU suite runs only the default one inside `rms_normalize_groups`."""
  from neurips26_jax.jaxops import rms_norm
  v = jax.random.normal(jax.random.key(9), (3, 5, 4))
  for dtype in (jnp.float32, jnp.bfloat16):
    a = rms_norm._expand_matmul(v, 24, dtype)
    b = rms_norm._expand_repeat(v, 24, dtype)
    assert a.dtype == b.dtype == dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(b[..., 6:12], np.float32),
                                  np.repeat(np.asarray(v[..., 1:2].astype(dtype), np.float32), 6, -1))

# ----------------------------------------------------------------------------- formulas and init

def test_swiglu_formula_and_init():
  layer = build(SwiGLU, 32, 48)
  x = normal(1, (2, 7, 32))
  expected = (silu(x @ P(layer.w_gate)) * (x @ P(layer.w_up))) @ P(layer.w_down)
  close(run(layer, x.astype(np.float32)), expected)
  # lecun_normal: std 1/sqrt(fan_in)
  for name, fan_in in (("w_gate", 32), ("w_up", 32), ("w_down", 48)):
    stats_match(getattr(layer, name)[...], std=fan_in ** -0.5, name=name)


def flashffn_numpy(layer, x, heads):
  """DESIGN.md section 2, steps 1-5, with the per-head RMSNorm (default on) and its gain."""
  b, l, d = x.shape
  d_h = d // heads
  q = (x @ P(layer.w_in)).reshape(b, l, heads, d_h)
  q = rms_norm(q, P(layer.norm_gain))
  out = np.zeros((b, l, heads, d_h))
  k, u, v, router = P(layer.k), P(layer.u), P(layer.v), P(layer.router)
  for h in range(heads):
    sig = sigmoid(q[:, :, h] @ router[h])                       # [b, l, E]
    r = sig / np.maximum(sig.sum(-1, keepdims=True), 1e-20)
    for e in range(k.shape[1]):
      a = silu(q[:, :, h] @ k[h, e].T) * (q[:, :, h] @ u[h, e].T)
      out[:, :, h] += r[..., e:e + 1] * (a @ v[h, e])
  return out.reshape(b, l, d) @ P(layer.w_out)


def test_flashffn_formula_with_defaults():
  """Defaults (head norm on) and the formula, through the layer's fast XLA path."""
  layer = build(FlashFFN, 32, 2, 3, 16, impl="xla")
  randomize(layer.norm_gain, 1)
  layer.router[...] = layer.router[...] * 50   # a router far from uniform
  x = normal(2, (2, 9, 32))
  close(run(layer, x.astype(np.float32)), flashffn_numpy(layer, x, heads=2))


def test_flashffn_paper_init():
  """init="paper": W_in, W_out Xavier-uniform gain 0.707; K, U, V normal(0, 0.02); router
  truncated normal(0, 0.02) (cut at 2 sigma); norm gain ones (DESIGN.md section 2)."""
  d, heads, experts, d_e = 128, 2, 4, 64
  layer = build(FlashFFN, d, heads, experts, d_e, init="paper")
  bound = 0.707 * math.sqrt(6 / (d + d))
  for name in ("w_in", "w_out"):
    stats_match(getattr(layer, name)[...], std=bound / math.sqrt(3), bound=bound, name=name)
  for name in ("k", "u", "v"):
    stats_match(getattr(layer, name)[...], std=0.02, name=name)
  router = np.asarray(layer.router[...])
  assert router.shape == (heads, d // heads, experts)
  # jax's truncated_normal(0.02) has std 0.02 and support +-2 * 0.02 / 0.8796
  stats_match(router, std=0.02, bound=2 * 0.02 / 0.87962566103423978, name="router")
  np.testing.assert_array_equal(layer.norm_gain[...], np.ones((heads, d // heads)))


def test_flashffn_scaled_init():
  """The default init (models/flash_ffn.py): W_in, W_out LeCun normal N(0, 1/d) (truncated at
  2 sigma, std exactly 1/sqrt(d)); K, U ~ N(0, 1/d_h); V ~ N(0, E/d_e); router as the paper's."""
  d, heads, experts, d_e = 128, 2, 4, 64
  layer = build(FlashFFN, d, heads, experts, d_e)
  for name in ("w_in", "w_out"):
    stats_match(getattr(layer, name)[...], std=d ** -0.5,
                bound=2 * d ** -0.5 / 0.87962566103423978, name=name)
  for name in ("k", "u"):
    stats_match(getattr(layer, name)[...], std=(d // heads) ** -0.5, name=name)
  stats_match(layer.v[...], std=math.sqrt(experts / d_e), name="v")
  stats_match(layer.router[...], std=0.02, bound=2 * 0.02 / 0.87962566103423978, name="router")
