"""Pack3D's multi-level far field in the Pallas kernels (`pallas_kernels.pack3d_attention`,
`levels` >= 2) against the independent float64 reference of DESIGN.md section 3.1
(`tests/independent_multilevel`): the Mosaic and Triton bodies in interpret mode (the Mosaic
GPU body through its interpreter with 64-slot cubes), float32 and bfloat16, the output and
the directional derivatives of q, k, v (and an [H] far offset), traced coordinates with
`max_top_cubes`, and the options the kernels refuse.

Layout and cases are the XLA path's (`tests/test_pack3d_levels`): 96 shuffled tokens in two
odd-sized fields and a padding field, (1, 2, 2) cubes, partial cubes inside a field. The
kernels take the per-head offset [H] only (per-level offsets [L, H] are the XLA path's), so
its [L, H] cases run here with an [H] offset. One case per body runs by default, the matrix
under `-m slow`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxops import pack3d_levels
from jaxops.pack3d_layout import cube_layout
from pallas_kernels import pack3d_attention as kernel
from tests import independent as ind
from tests import independent_checks as ic
from tests import independent_multilevel as iml
from tests import test_pack3d_levels as xla_cases
from tests.test_flash_ffn import mosaic_gpu_interpreter, needs_mosaic_gpu

F32, BF16 = jnp.float32, jnp.bfloat16
COORDS, FIELDS, BLOCK = xla_cases.COORDS, xla_cases.FIELDS, xla_cases.BLOCK
H, D, N = xla_cases.H, xla_cases.D, xla_cases.N
BETA = xla_cases.BETA[0]                               # [H]
# name: (levels, radius_blocks, level_radius, with an [H] far offset)
CASES = {name: (*case[:3], case[3] is not None) for name, case in xla_cases.CASES.items()
         if case[0] > 1}
# 8 summaries per block: the far stream walks several blocks (level 1's cubes, then the
# higher levels', mixed in one block); Triton's dK/dV walks each 4-slot cube in 2 row blocks.
BODIES = {"mosaic": dict(block_summaries=8),
          "triton": dict(block_summaries=8, block_q_dkv=2)}
# Relative to max|reference|. Measured (f32): output <= 4e-7, gradients <= 2e-6; bf16:
# output <= 4.4e-3, gradients <= 4e-3 (inputs, summaries and probabilities rounded to bf16).
TOL = {F32: 1e-5, BF16: 1.5e-2}
GRAD_TOL = {F32: 1e-5, BF16: 2e-2}


@functools.lru_cache(maxsize=None)
def _inputs():
  """A cotangent W and one direction per input (q, k, v, far offset)."""
  rng = np.random.default_rng(11)
  w = rng.standard_normal((1, N, H, D))
  return w, [rng.standard_normal((1, N, H, D)) for _ in range(3)] + [rng.standard_normal(H)]


def _op(body: str, case: str, coords=COORDS, fields=FIELDS, **options):
  levels, radius, level_radius, _ = CASES[case]
  return functools.partial(kernel.pack3d_attention, coords=coords, field_ids=fields,
                           block_shape=BLOCK, radius_blocks=radius, levels=levels,
                           level_radius=level_radius, backend=body, interpret=True,
                           **BODIES[body], **options)


def _reference(case: str, q, k, v, beta):
  levels, radius, level_radius, _ = CASES[case]
  return iml.multilevel_attention_reference(q, k, v, COORDS, FIELDS, block_shape=BLOCK,
                                            radius_blocks=radius, levels=levels,
                                            level_radius=level_radius, far_offset=beta)


def check_case(op, case: str, dtype, grads: bool = True):
  """The op's output (and its VJP along W in q, k, v and the offset) against the reference
  on the inputs as the op sees them (bf16-rounded in bf16)."""
  offset = CASES[case][3]
  qkv = [ic.rounded(a, dtype) for a in (xla_cases.Q, xla_cases.K, xla_cases.V)]
  primals = qkv + ([BETA] if offset else [])
  args = [ic.cast(a, dtype) for a in qkv] + ([ic.cast(BETA, F32)] if offset else [])
  fn = lambda q, k, v, *beta: op(q, k, v, far_offset=beta[0] if beta else None)
  out, vjp = jax.vjp(fn, *args)
  assert out.dtype == dtype
  reference = lambda q, k, v, *beta: _reference(case, q, k, v, beta[0] if beta else None)
  ic.check(out, reference(*primals), rtol=TOL[dtype], name=f"{case} out")
  if not grads:
    return
  w, directions = _inputs()
  w = ic.rounded(w, dtype)
  loss = lambda *a: float(np.sum(w * reference(*a)))
  derivs = [ind.directional_derivative(loss, primals, i, directions[i])
            for i in range(len(primals))]
  ic.check_directional(vjp(ic.cast(w, dtype)), derivs, directions[:len(primals)],
                       rtol=GRAD_TOL[dtype], name=["q", "k", "v", "far_offset"][:len(primals)])


DEFAULT = {("mosaic", "L3_r1_2_1", "f32"), ("triton", "L2_r1", "bf16")}


@pytest.mark.parametrize("body, case, dtype", [
    pytest.param(body, case, dtype, id=f"{body}-{case}-{dtype}",
                 marks=() if (body, case, dtype) in DEFAULT else pytest.mark.slow)
    for body in BODIES for case in CASES for dtype in ("f32", "bf16")])
def test_kernel_matches_the_independent_reference(body, case, dtype):
  check_case(_op(body, case), case, {"f32": F32, "bf16": BF16}[dtype])


def test_one_level_is_the_single_level_kernel():
  """levels=1 runs today's tables and far test: bit-identical to the call without levels."""
  args = [jnp.asarray(a, F32) for a in (xla_cases.Q, xla_cases.K, xla_cases.V)]
  run = lambda **o: kernel.pack3d_attention(*args, COORDS, FIELDS, block_shape=BLOCK,
                                            backend="triton", interpret=True, **o)
  assert np.array_equal(np.asarray(run(levels=1, level_radius=None)), np.asarray(run()))


def test_traced_coordinates_with_max_top_cubes():
  """Coords traced (max_cubes slots, the top level bounded by max_top_cubes): the exact top
  slot count gives the concrete result; one slot fewer would drop a top-level cube, so the
  entry's output is NaN."""
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


@pytest.mark.parametrize("options, match", [
    ({"levels": 3, "far_offset": np.zeros((3, H))}, r"`far_offset` of shape \[levels, H\]"),
    ({"levels": 2, "summary_rope": {"theta": 100.0}}, "`summary_rope` is a single-level"),
    ({"max_top_cubes": 4}, "`max_top_cubes` is a multi-level option"),
    ({"levels": 2, "max_top_cubes": 0}, "max_top_cubes"),
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
  from models import Pack3DAttention
  make = lambda impl: Pack3DAttention(12, H, block_shape=BLOCK, levels=3, level_radius=(2, 1),
                                      far_offset=True, impl=impl, rngs=nnx.Rngs(0))
  layer, xla = make("pallas"), make("xla")
  assert layer.impl == "pallas"
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, N, 12)), F32)
  np.testing.assert_allclose(layer(x, COORDS, FIELDS), xla(x, COORDS, FIELDS), rtol=1e-5,
                             atol=1e-6)
