"""Pack3DAttention layer: impls agree, repacking invariance of axial RoPE (and its absence
for the packed-index baselines), the learnable far offset (also split over heads), options,
bad configuration; the layer with its defaults against its formula in float64 numpy
(tests/layer_formula_checks.py), and its initialisation."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.jaxops import pack3d as pack3d_ops
from neurips26_jax.jaxops import packing
from neurips26_jax.models import partitioning
from neurips26_jax.models.pack3d import Pack3DAttention
from neurips26_jax.train.optim import decay_mask
from tests import kernel_checks
from tests.layer_formula_checks import (build, close, normal, pack3d_layer_numpy,
                                         stats_match, two_fields)
from tests.test_pack3d import BLOCK, COORDS, FIELD_IDS

D_MODEL, HEADS = 24, 2  # head dim 12, divisible by 6
X = jax.random.normal(jax.random.key(0), COORDS.shape[:2] + (D_MODEL,))


def layer(**kwargs):
  return Pack3DAttention(D_MODEL, HEADS, block_shape=BLOCK, rngs=nnx.Rngs(0), **kwargs)


def run(module, x=X, coords=COORDS, field_ids=FIELD_IDS):
  """The layer under jit with concrete (closed-over) coords."""
  return nnx.jit(lambda m, x: m(x, coords, field_ids))(module, x)


# slow: the layer's one op call is test_far_offset_impls_agree_forward_and_gradients's; the
# paths without the offset are test_pack3d.py::test_matches_reference_forward_and_gradients's.
@pytest.mark.slow
def test_impls_agree():
  out = {impl: run(layer(impl=impl)) for impl in ("pallas", "xla", "reference")}
  assert out["reference"].shape == X.shape
  for impl in ("pallas", "xla"):
    kernel_checks.assert_close(out[impl], out["reference"], rtol=1e-5, name=impl)


def test_gated_merge_and_rotate_after_compression():
  kwargs = dict(merge="gated", rotate_summaries="after", block_bias=False, radius_blocks=0)
  kernel_checks.assert_close(run(layer(impl="xla", **kwargs)),
                             run(layer(impl="reference", **kwargs)), rtol=1e-5)


def _offset_layer(impl, offset=(0.6, -0.9)):
  """A far_offset layer with a nonzero offset (as after some training)."""
  module = layer(impl=impl, far_offset=True)
  module.far_offset[...] = jnp.asarray(offset)
  return module


def _value_and_grads(module, x=X):
  loss = lambda m, x: jnp.sum(jnp.sin(m(x, COORDS, FIELD_IDS)))
  return nnx.jit(nnx.value_and_grad(loss))(module, x)


def test_far_offset_parameter():
  """Off by default; on, a [H] parameter over "heads" starting at 0 (the plain log(n_b)
  bias: the same output as without it) that AdamW never decays."""
  assert layer().far_offset is None
  module = layer(impl="xla", far_offset=True)
  assert module.far_offset.shape == (HEADS,) and not np.any(np.asarray(module.far_offset[...]))
  assert partitioning.logical_axes(module.far_offset) == ("heads",)
  assert not decay_mask(nnx.state(module, nnx.Param))["far_offset"]
  np.testing.assert_array_equal(run(module), run(layer(impl="xla")))


def test_far_offset_impls_agree_forward_and_gradients():
  """A nonzero offset reaches every impl: outputs and every parameter's gradient (the
  offset's included) agree with the reference impl, and differ from the offset-free layer."""
  results = {impl: _value_and_grads(_offset_layer(impl)) for impl in ("pallas", "xla",
                                                                      "reference")}
  (value, grads) = results["reference"]
  assert abs(float(value) - float(_value_and_grads(layer(impl="reference"))[0])) > 1e-3
  assert float(jnp.min(jnp.abs(grads["far_offset"][...]))) > 0
  for impl in ("pallas", "xla"):
    got_value, got = results[impl]
    kernel_checks.assert_close(got_value, value, rtol=1e-5, name=impl)
    for path, g in nnx.to_flat_state(grads):
      kernel_checks.assert_close(dict(nnx.to_flat_state(got))[path][...], g[...], rtol=1e-5,
                                 name=f"{impl} d{'.'.join(map(str, path))}")


def test_far_offset_splits_over_heads_under_shard_layer(monkeypatch):
  """Under shard_layer(split_heads=True) on a 2x2x2 mesh each device gets its local head's
  offset ([1] of [2]); output and gradients (the offset's included) equal one device's."""
  module = _offset_layer("xla")
  seen, original = [], pack3d_ops.pack3d_attention

  def spy(*args, far_offset, **kwargs):
    seen.append(far_offset.shape)
    return original(*args, far_offset=far_offset, **kwargs)

  monkeypatch.setattr(pack3d_ops, "pack3d_attention", spy)
  loss = lambda m, x, c, f: jnp.sum(jnp.sin(partitioning.shard_layer(m, x, c, f,
                                                                     split_heads=True)))
  step = nnx.jit(nnx.value_and_grad(loss))
  # batch 4: one entry per data x fsdp device
  x = jnp.concatenate([X, jax.random.normal(jax.random.key(1), X.shape)])
  coords, field_ids = (np.concatenate([a, a]) for a in (COORDS, FIELD_IDS))
  expected = step(module, x, coords, field_ids)
  assert seen[-1] == (HEADS,)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2),
                          partitioning.MESH_AXES)
  with jax.set_mesh(mesh):
    got = step(module, x, coords, field_ids)
  assert seen[-1] == (1,)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    kernel_checks.assert_close(a, b, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def _traced(position: str):
  """The XLA-path layer under jit with traced coords and field ids (max_cubes slots)."""
  module = layer(impl="xla", position=position, max_len=COORDS.shape[1], max_cubes=40)
  return functools.partial(nnx.jit(lambda m, x, c, f: m(x, c, f)), module)


def _repacked(layout: str):
  """Per-entry permutations into `layout` and a function applying them to [B, N, ...]."""
  perms = [packing.layout_permutation(COORDS[b], FIELD_IDS[b], layout, block_shape=BLOCK,
                                      seed=3)[0] for b in range(len(COORDS))]
  return lambda x: jnp.stack([jnp.asarray(x)[b][p] for b, p in enumerate(perms)])


@pytest.mark.parametrize("position", ["axial_rope", "none"])
def test_output_permutes_with_tokens_under_every_layout(position):
  base = _traced(position)(X, COORDS, FIELD_IDS)
  for layout in packing.LAYOUTS:
    take = _repacked(layout)
    out = _traced(position)(take(X), take(COORDS), take(FIELD_IDS))
    kernel_checks.assert_close(out, take(base), rtol=1e-5, name=layout)


@pytest.mark.parametrize("position", ["learned_packed", "rope_packed"])
def test_packed_index_positions_change_under_repacking(position):
  base = _traced(position)(X, COORDS, FIELD_IDS)
  take = _repacked("hilbert")
  out = _traced(position)(take(X), take(COORDS), take(FIELD_IDS))
  scale = float(jnp.max(jnp.abs(base)))
  assert float(jnp.max(jnp.abs(out - take(base)))) > 1e-2 * scale


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="cuda"), "`impl` must be one of"),
    (dict(position="sinusoidal"), "`position` must be one of"),
    (dict(position="learned_packed"), "needs `max_len`"),
    (dict(merge="gated", impl="pallas"), "merge='gated' needs impl"),
    (dict(merge="mean"), "`merge` must be"),
    (dict(rotate_summaries="after", position="none"), "needs position='axial_rope'"),
])
def test_bad_config_is_an_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    layer(**kwargs)


def test_bad_shapes_are_errors():
  with pytest.raises(ValueError, match="divisible by 6"):
    Pack3DAttention(32, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="multiple of `num_heads`"):
    Pack3DAttention(30, 4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="`x` must be"):
    layer()(X[..., :5], COORDS, FIELD_IDS)
  with pytest.raises(ValueError, match="more than max_len"):
    layer(position="learned_packed", max_len=10)(X, COORDS, FIELD_IDS)
  with pytest.raises(ValueError, match="`coords` has shape"):
    layer(impl="xla")(X, np.asarray(COORDS)[:, :, :2], FIELD_IDS)


# ----------------------------------------------------------------------------- formula and init

def test_pack3d_attention_formula_with_defaults():
  coords, field_ids = two_fields()
  layer = build(Pack3DAttention, 36, 2, impl="xla")   # head dim 18: m = 3 per axis
  x = normal(1, coords.shape[:2] + (36,))
  got = nnx.jit(lambda m, x: m(x, coords, field_ids))(layer, jnp.asarray(x, jnp.float32))
  close(got, pack3d_layer_numpy(layer, x, coords, field_ids, heads=2))


def test_pack3d_attention_init():
  """Xavier-uniform (gain 1) W_qkv [d, 3d] (stored [d, 3, d]) and W_out [d, d]."""
  d = 96
  layer = build(Pack3DAttention, d, 2)
  assert layer.w_qkv.shape == (d, 3, d)
  for name, fan_out in (("w_qkv", 3 * d), ("w_out", d)):
    bound = math.sqrt(6 / (d + fan_out))
    stats_match(getattr(layer, name)[...], std=bound / math.sqrt(3), bound=bound, name=name)
