"""Pack3D's multi-level far field in the Pallas kernels (`pallas_kernels.pack3d_attention`,
`levels` >= 2) against the independent float64 reference of DESIGN.md section 3.1
(`tests/independent_multilevel`): the Mosaic and Triton bodies in interpret mode (the Mosaic
GPU body through its interpreter with 64-slot cubes), float32 and bfloat16, the output and
the directional derivatives of q, k, v and the far offset ([H], or [L, H] per level),
traced coordinates with `max_top_cubes`, and the options the kernels refuse.

Layout and cases are the XLA path's (`tests/test_pack3d_levels`): 96 shuffled tokens in two
odd-sized fields and a padding field, (1, 2, 2) cubes, partial cubes inside a field. One
case per body runs by default, the matrix under `-m slow`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import pack3d_levels
from neurips26_jax.jaxops.pack3d_layout import cube_layout
from neurips26_jax.pallas_kernels import pack3d_attention as kernel
from tests import independent as ind
from tests import independent_checks as ic
from tests import independent_multilevel as iml
from tests import test_pack3d_levels as xla_cases
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu

F32, BF16 = jnp.float32, jnp.bfloat16
COORDS, FIELDS, BLOCK = xla_cases.COORDS, xla_cases.FIELDS, xla_cases.BLOCK
H, D, N = xla_cases.H, xla_cases.D, xla_cases.N
# name: (levels, radius_blocks, level_radius, far offset: None, "h" [H] or "lh" [L, H],
#        level_key_gain: None for the default)
CASES = {name: case for name, case in xla_cases.CASES.items() if case[0] > 1}


def _beta(case: str):
  levels, kind = CASES[case][0], CASES[case][3]
  return {None: None, "h": xla_cases.BETA[0], "lh": xla_cases.BETA[:levels]}[kind]
# 8 summaries per block: the far stream walks several blocks (level 1's cubes, then the
# higher levels', mixed in one block); Triton's dK/dV walks each 4-slot cube in 2 row blocks.
BODIES = {"mosaic": dict(block_summaries=8),
          "triton": dict(block_summaries=8, block_q_dkv=2)}
# Relative to max|reference| (gradients: `independent_checks.check_directional`'s scale).
# Measured over the matrix, Mosaic and Triton: f32 output <= 1.6e-7, gradients <= 2.5e-7;
# bf16 output <= 2.4e-3 (the bf16 output's own rounding), gradients <= 4.0e-3 (summaries and
# probabilities enter the matmuls rounded to bf16). Mosaic GPU: f32 2.5e-7 / 1.9e-7, bf16
# 3.4e-3 / 2.2e-3.
TOL = {F32: 1e-5, BF16: 1e-2}
GRAD_TOL = {F32: 1e-5, BF16: 1e-2}


def _op(body: str, case: str, coords=COORDS, fields=FIELDS, block=BLOCK, **options):
  levels, radius, level_radius, _, gain = CASES[case]
  interpret = mosaic_gpu_interpreter() if body == "mosaic_gpu" else True
  return functools.partial(kernel.pack3d_attention, coords=coords, field_ids=fields,
                           block_shape=block, radius_blocks=radius, levels=levels,
                           level_radius=level_radius, level_key_gain=gain, backend=body,
                           interpret=interpret,
                           **BODIES.get(body, {}), **options)


def _reference(case: str, coords=COORDS, fields=FIELDS, block=BLOCK):
  """The float64 reference of `case` as a function of (q, k, v[, beta])."""
  levels, radius, level_radius, _, gain = CASES[case]
  return lambda q, k, v, *beta: iml.multilevel_attention_reference(
      q, k, v, coords, fields, block_shape=block, radius_blocks=radius, levels=levels,
      level_radius=level_radius, far_offset=beta[0] if beta else None,
      level_key_gain=xla_cases.DEFAULT_KEY_GAIN if gain is None else gain)


def check_case(op, reference, qkv, beta, dtype):
  """The op's output and its VJP along a random W in q, k, v (and the offset beta, if not
  None) against the reference on the inputs as the op sees them (bf16-rounded in bf16):
  directional derivatives along random directions."""
  qkv = [ic.rounded(a, dtype) for a in qkv]
  primals = qkv + ([] if beta is None else [np.asarray(beta, np.float64)])
  args = [ic.cast(a, dtype) for a in qkv] + ([] if beta is None else [ic.cast(beta, F32)])
  out, vjp = jax.vjp(lambda q, k, v, *b: op(q, k, v, far_offset=b[0] if b else None), *args)
  assert out.dtype == dtype
  ic.check(out, reference(*primals), rtol=TOL[dtype], name="out")
  rng = np.random.default_rng(11)
  w = ic.rounded(rng.standard_normal(qkv[0].shape), dtype)
  directions = [rng.standard_normal(np.shape(a)) for a in primals]
  loss = lambda *a: float(np.sum(w * reference(*a)))
  derivs = [ind.directional_derivative(loss, primals, i, directions[i])
            for i in range(len(primals))]
  ic.check_directional(vjp(ic.cast(w, dtype)), derivs, directions, rtol=GRAD_TOL[dtype],
                       name=["q", "k", "v", "far_offset"][:len(primals)])


DEFAULT = {("mosaic", "L3_r1_2_1", "f32"), ("triton", "L3_r0", "bf16")}


@pytest.mark.parametrize("body, case, dtype", [
    pytest.param(body, case, dtype, id=f"{body}-{case}-{dtype}",
                 marks=() if (body, case, dtype) in DEFAULT else pytest.mark.slow)
    for body in BODIES for case in CASES for dtype in ("f32", "bf16")])
def test_kernel_matches_the_independent_reference(body, case, dtype):
  check_case(_op(body, case), _reference(case), (xla_cases.Q, xla_cases.K, xla_cases.V),
             _beta(case), {"f32": F32, "bf16": BF16}[dtype])


# slow (40 s in its interpreter): the default run checks the Hopper body at one level
# (tests/test_pack3d_mosaic_gpu.py) and the level tables on the other bodies.
@needs_mosaic_gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_mosaic_gpu_body_matches_the_independent_reference(dtype):
  """The Hopper body (64-slot cubes, its interpreter with the race detector) on the layout of
  `tests/test_pack3d_mosaic_gpu` ((4, 3, 4) cubes, two batch entries, odd fields), 3 levels
  of radius 0: each query cube attends to its level-1 siblings, its level-2 parent's
  siblings, and (in the (9, 2, 3) field) nothing at the top; D = 16, per-level far offsets
  [L, H]."""
  from tests import test_pack3d_mosaic_gpu as hopper
  rng = np.random.default_rng(4)
  qkv = [rng.standard_normal(hopper.COORDS.shape[:2] + (H, 16)) for _ in range(3)]
  layout = dict(coords=hopper.COORDS, fields=hopper.FIELDS, block=hopper.BLOCK)
  check_case(_op("mosaic_gpu", "L3_r0", **layout), _reference("L3_r0", **layout), qkv,
             _beta("L3_r0"), dtype)


def test_one_level_is_the_single_level_kernel():
  """levels=1 runs today's tables and far test: bit-identical to the call without levels."""
  args = [jnp.asarray(a, F32) for a in (xla_cases.Q, xla_cases.K, xla_cases.V)]
  run = lambda **o: kernel.pack3d_attention(*args, COORDS, FIELDS, block_shape=BLOCK,
                                            backend="triton", interpret=True, **o)
  assert np.array_equal(np.asarray(run(levels=1, level_radius=None)), np.asarray(run()))


def test_traced_coordinates_with_max_top_cubes():
  """Coords traced (max_cubes slots, the top level bounded by max_top_cubes, the levels
  below by 8^(L-k) times it): the exact top slot count gives the concrete result; one slot
  fewer would drop a top-level cube, so the entry's output is NaN. Concrete coords closed
  over by a jitted function give the concrete result too."""
  case = "L3_r1_2_1"
  args = [jnp.asarray(a, F32) for a in (xla_cases.Q, xla_cases.K, xla_cases.V)]
  layout = cube_layout(COORDS, FIELDS, block_shape=BLOCK, radius_blocks=1)
  exact = pack3d_levels.top_slots(layout.keys, layout.count, CASES[case][0])
  assert 1 < exact < 80
  traced = jax.jit(lambda q, k, v, c, f, top: _op("triton", case, c, f, max_cubes=80,
                                                  max_top_cubes=top)(q, k, v),
                   static_argnums=5)
  concrete = _op("triton", case)(*args)
  np.testing.assert_allclose(traced(*args, COORDS, FIELDS, exact), concrete, rtol=1e-6,
                             atol=1e-6)
  assert bool(jnp.all(jnp.isnan(traced(*args, COORDS, FIELDS, exact - 1))))
  # concrete coords inside a jitted function: every level's slots known at trace time
  jitted = jax.jit(lambda q, k, v: _op("triton", case)(q, k, v))(*args)
  np.testing.assert_allclose(jitted, concrete, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("options, match", [
    ({"levels": 3, "far_offset": np.zeros((2, H))}, r"`far_offset` has shape \(2, 2\)"),
    ({"levels": 2, "summary_rope": {"theta": 100.0}}, "`summary_rope` is a single-level"),
    ({"max_top_cubes": 4}, "`max_top_cubes` is a multi-level option"),
    ({"levels": 2, "max_top_cubes": 0}, "max_top_cubes"),
    ({"level_key_gain": 8.0}, "`level_key_gain` is a multi-level option"),
    ({"levels": 3, "radius_blocks": 4, "level_radius": 1}, "level-2 radius 1 is below"),
])
def test_bad_level_options_are_one_line_errors(options, match):
  args = [jnp.asarray(a, F32) for a in (xla_cases.Q, xla_cases.K, xla_cases.V)]
  with pytest.raises(ValueError, match=match):
    kernel.pack3d_attention(*args, COORDS, FIELDS, block_shape=BLOCK, interpret=True,
                            **options)


def test_layer_with_levels_runs_the_kernel():
  """Pack3DAttention(levels=3, impl="pallas") (with its per-head far offset) gives the XLA
  path's layer output with the same parameters."""
  from flax import nnx
  from neurips26_jax.models import Pack3DAttention
  make = lambda impl: Pack3DAttention(12, H, block_shape=BLOCK, levels=3, level_radius=(2, 1),
                                      far_offset=True, impl=impl, rngs=nnx.Rngs(0))
  layer, xla = make("pallas"), make("xla")
  assert layer.impl == "pallas"
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, N, 12)), F32)
  np.testing.assert_allclose(layer(x, COORDS, FIELDS), xla(x, COORDS, FIELDS), rtol=1e-5,
                             atol=1e-6)


def test_auto_picks_the_kernel_with_levels_where_it_compiles(monkeypatch):
  """`impl="auto"` with levels is the kernel on a TPU or GPU (the XLA path on CPU)."""
  from flax import nnx
  from neurips26_jax.models import Pack3DAttention
  from neurips26_jax.models import impl as impl_module
  for compiled, expected in ((True, "pallas"), (False, "xla")):
    monkeypatch.setattr(impl_module, "compiles_kernels", lambda c=compiled: c)
    assert Pack3DAttention(12, H, levels=2, rngs=nnx.Rngs(0)).impl == expected
