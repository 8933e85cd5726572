"""Pack3D's multi-level far field on the XLA path (`jaxops.pack3d`, `levels` >= 2) against the
independent float64 reference written from DESIGN.md section 3.1 (`tests/independent_multilevel`,
which shares no code with the fast path): outputs in float32 and bfloat16, gradients of q, k,
v and the per-level far offset, the radius rule, and the arguments it refuses."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops import pack3d as ops
from tests import independent_checks as ic
from tests import independent_multilevel as iml

BLOCK = (1, 2, 2)  # non-cubic level-1 cubes
H, D = 2, 8


def _grid(shape):
  return np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, 3)


def _layout():
  """One batch entry of 96 shuffled tokens: a (10, 3, 2) field less 3 random tokens (partial
  cubes inside, 3+ level-3 cubes along z), a (2, 5, 3) field, and 9 padding tokens (their own
  field id, as the data pipeline lays them out)."""
  rng = np.random.default_rng(5)
  a = _grid((10, 3, 2))
  a = a[np.sort(rng.choice(len(a), len(a) - 3, replace=False))]
  pad = np.stack([np.arange(9) // 4, np.arange(9) % 4, np.zeros(9, int)], -1)
  coords = np.concatenate([a, _grid((2, 5, 3)), pad])
  fields = np.array([4] * len(a) + [1] * 30 + [8] * 9)
  perm = rng.permutation(len(fields))
  return coords[perm][None].astype(np.int32), fields[perm][None].astype(np.int32)


COORDS, FIELDS = _layout()
N = FIELDS.shape[1]
RNG = np.random.default_rng(0)
Q, K, V = (RNG.standard_normal((1, N, H, D)) for _ in range(3))
BETA = np.array([[0.6, -1.1], [-0.3, 0.9], [1.4, 0.2]])  # [L = 3, H]

# The documented default level_key_gain (DESIGN.md 3.1): the op's None must mean this.
DEFAULT_KEY_GAIN = 8.0
CASES = {  # name: (levels, radius_blocks, level_radius, beta, level_key_gain; None: default)
    "L1": (1, 1, None, None, None),
    "L2_r1": (2, 1, None, None, 1.0),
    "L2_r1_default_gain": (2, 1, None, "h", None),
    "L3_r1": (3, 1, None, "h", 1.0),
    "L3_r0": (3, 0, None, "lh", 1.0),
    "L3_r2_1": (3, 2, 1, None, 2.5),
    "L3_r1_2_1": (3, 1, (2, 1), "lh", 3.0),  # g^2 = 9, not 2g = 6 or g + g
}


def _beta(kind, levels):
  return {None: None, "h": BETA[0], "lh": BETA[:levels]}[kind]


def _xla(q, k, v, beta, levels, radius_blocks, level_radius, gain=None):
  return ops.pack3d_attention(q, k, v, COORDS, FIELDS, block_shape=BLOCK,
                              radius_blocks=radius_blocks, levels=levels,
                              level_radius=level_radius, far_offset=beta, chunk=3,
                              level_key_gain=gain)


def _reference(q, k, v, beta, levels, radius_blocks, level_radius, gain=None):
  return iml.multilevel_attention_reference(
      q, k, v, COORDS, FIELDS, block_shape=BLOCK, radius_blocks=radius_blocks, levels=levels,
      level_radius=level_radius, far_offset=beta,
      level_key_gain=DEFAULT_KEY_GAIN if gain is None else gain)


# Every case in float32; bfloat16 (the casts, the float32 softmax and far field around bf16
# matmuls, shared by every level structure) on one case per far-offset shape, the others
# slow: their level structures are the float32 cases'.
BF16_FAST = ("L2_r1_default_gain", "L3_r1_2_1")


@pytest.mark.parametrize("case, dtype, rtol", [
    pytest.param(case, dtype, rtol, id=f"{case}-{name}",
                 marks=() if dtype == jnp.float32 or case in BF16_FAST else pytest.mark.slow)
    for case in CASES for dtype, rtol, name in ((jnp.float32, 2e-5, "f32"),
                                                (jnp.bfloat16, 2e-2, "bf16"))])
def test_xla_path_matches_the_independent_reference(case, dtype, rtol):
  levels, radius, level_radius, beta, gain = CASES[case]
  beta = _beta(beta, levels)
  args = [ic.cast(a, dtype) for a in (Q, K, V)]
  out = _xla(*args, None if beta is None else jnp.asarray(beta, jnp.float32), levels, radius,
             level_radius, gain)
  assert out.dtype == dtype
  expected = _reference(*(ic.rounded(a, dtype) for a in (Q, K, V)), beta, levels, radius,
                        level_radius, gain)
  ic.check(out, expected, rtol=rtol, name=case)


def test_levels_change_the_result():
  """Guards the comparison above against a case where the levels coincide: on this layout
  two and three levels give outputs other than one level's (coarser far summaries)."""
  outs = [np.asarray(_xla(*(jnp.asarray(a, jnp.float32) for a in (Q, K, V)), None, L, 1, None))
          for L in (1, 2, 3)]
  assert np.max(np.abs(outs[1] - outs[0])) > 1e-3
  assert np.max(np.abs(outs[2] - outs[1])) > 1e-3


def test_gradients_match_the_reference_directional_derivatives():
  """<dL/dX, dX> for q, k, v and the [L, H] far offset (L = sum(W * o)) against the central
  difference of the float64 reference along the same random direction (key gain 3: the
  gradient through the scaled level-2 and level-3 keys)."""
  levels, radius, level_radius, gain = 3, 1, (2, 1), 3.0
  rng = np.random.default_rng(3)
  weight = rng.standard_normal((1, N, H, D))
  inputs = (Q, K, V, BETA)
  directions = [rng.standard_normal(a.shape) for a in inputs]
  loss = lambda q, k, v, b: jnp.sum(jnp.asarray(weight, jnp.float32)
                                    * _xla(q, k, v, b, levels, radius, level_radius, gain))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(a, jnp.float32)
                                                          for a in inputs))
  eps, derivs = 1e-4, []
  for i, d in enumerate(directions):
    shifted = lambda s: [a + s * eps * d if j == i else a for j, a in enumerate(inputs)]
    plus, minus = (np.sum(weight * _reference(*shifted(s), levels, radius, level_radius, gain))
                   for s in (1, -1))
    derivs.append((plus - minus) / (2 * eps))
  ic.check_directional(grads, derivs, directions, rtol=1e-4, name="qkvb")


def test_one_level_is_the_single_level_op():
  args = [jnp.asarray(a, jnp.float32) for a in (Q, K, V)]
  single = ops.pack3d_attention(*args, COORDS, FIELDS, block_shape=BLOCK, chunk=3)
  assert np.array_equal(np.asarray(_xla(*args, None, 1, 1, None)), np.asarray(single))


@pytest.mark.parametrize("options, match", [
    ({"levels": 0}, "`levels` must be an int >= 1"),
    ({"levels": 3, "radius_blocks": 4, "level_radius": 1}, "level-2 radius 1 is below"),
    ({"levels": 3, "level_radius": (1,)}, "`level_radius` needs levels - 1 = 2"),
    ({"levels": 2, "far_offset": np.zeros((3, H))}, r"`far_offset` has shape \(3, 2\)"),
    ({"levels": 2, "gates": np.zeros((1, N, H, 2))}, "single-level options"),
    ({"levels": 2, "summary_rope": {"theta": 100.0}}, "single-level options"),
    ({"max_top_cubes": 4}, "`max_top_cubes` is a multi-level option"),
    ({"levels": 2, "max_top_cubes": 0}, "max_top_cubes"),
    ({"level_key_gain": 8.0}, "`level_key_gain` is a multi-level option"),
    *[({"levels": 2, "level_key_gain": g}, "`level_key_gain` must be a number > 0 and finite")
      for g in (0.0, -1.0, True, float("inf"), float("nan"), 1e39, "8", np.ones(2))],
])
def test_bad_level_options_are_one_line_errors(options, match):
  args = [jnp.asarray(a, jnp.float32) for a in (Q, K, V)]
  with pytest.raises(ValueError, match=match):
    ops.pack3d_attention(*args, COORDS, FIELDS, block_shape=BLOCK, **options)


@pytest.mark.parametrize("layer_gain, op_gain", [(3.0, 3.0), (None, DEFAULT_KEY_GAIN)])
def test_layer_with_levels_is_its_formula(layer_gain, op_gain):
  """Pack3DAttention(levels=3, level_key_gain=g): x W_qkv -> axial RoPE on the coordinates ->
  the multi-level op with g (None: the documented default) -> W_out; `impl="auto"` resolves
  to the XLA path where kernels do not compile (CPU)."""
  from flax import nnx
  from neurips26_jax.jaxops import rope
  from neurips26_jax.models import Pack3DAttention
  layer = Pack3DAttention(12, H, block_shape=BLOCK, levels=3, level_radius=(2, 1),
                          level_key_gain=layer_gain, rngs=nnx.Rngs(0))
  assert layer.impl == "xla"
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, N, 12)), jnp.float32)
  qkv = (x @ layer.w_qkv[...].reshape(12, -1)).reshape(1, N, 3, H, 6)
  q, k = (rope.axial_rope_3d(t, COORDS) for t in (qkv[:, :, 0], qkv[:, :, 1]))
  o = ops.pack3d_attention(q, k, qkv[:, :, 2], COORDS, FIELDS, block_shape=BLOCK, levels=3,
                           level_radius=(2, 1), level_key_gain=op_gain)
  expected = o.reshape(1, N, 12) @ layer.w_out[...]
  np.testing.assert_allclose(layer(x, COORDS, FIELDS), expected, rtol=1e-5, atol=1e-6)


def test_layer_refuses_multi_level_options_with_one_level():
  from flax import nnx
  from neurips26_jax.models import Pack3DAttention
  with pytest.raises(ValueError, match="Pack3DAttention: `level_key_gain` is a multi-level"):
    Pack3DAttention(12, H, level_key_gain=8.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("options", [{"impl": "reference"}, {"merge": "local"},
                                     {"rotate_summaries": "after"}])
def test_layer_refuses_levels_where_it_has_no_path(options):
  from flax import nnx
  from neurips26_jax.models import Pack3DAttention
  with pytest.raises(ValueError, match="levels=2 needs impl 'auto', 'xla' or 'pallas'"):
    Pack3DAttention(12, H, levels=2, rngs=nnx.Rngs(0), **options)


def _three_levels(q, k, v, coords, fields, top=None):
  return ops.pack3d_attention(q, k, v, coords, fields, block_shape=BLOCK, levels=3,
                              level_radius=(2, 1), max_cubes=80, chunk=3, max_top_cubes=top)


_traced = jax.jit(_three_levels, static_argnums=5)


@functools.cache
def _concrete():
  """`_three_levels` on concrete coords (closed over): the top level's slots known at trace
  time. One compile for the two tests below."""
  args = [jnp.asarray(a, jnp.float32) for a in (Q, K, V)]
  return jax.jit(lambda q, k, v: _three_levels(q, k, v, COORDS, FIELDS))(*args)


def test_traced_coordinates_give_the_same_result():
  """With coords traced (cube slots bounded by max_cubes, the top level by it too) the op is
  the one computed from concrete coords."""
  args = [jnp.asarray(a, jnp.float32) for a in (Q, K, V)]
  np.testing.assert_allclose(_traced(*args, COORDS, FIELDS), _concrete(), rtol=1e-6, atol=1e-6)


def test_max_top_cubes_bounds_the_top_level_and_poisons_an_overflow():
  """Traced coords with max_top_cubes = the top level's exact slot count give the concrete
  result; one slot fewer would drop a top-level cube, so the entry's output is NaN (never a
  silently wrong answer)."""
  from neurips26_jax.jaxops import pack3d_levels
  args = [jnp.asarray(a, jnp.float32) for a in (Q, K, V)]
  layout = ops.cube_layout(COORDS, FIELDS, block_shape=BLOCK, radius_blocks=1)
  exact = pack3d_levels.top_slots(layout.keys, layout.count, 3)
  assert 1 < exact < 80
  np.testing.assert_allclose(_traced(*args, COORDS, FIELDS, exact), _concrete(), rtol=1e-6,
                             atol=1e-6)
  assert bool(jnp.all(jnp.isnan(_traced(*args, COORDS, FIELDS, exact - 1))))
