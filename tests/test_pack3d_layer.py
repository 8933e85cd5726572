"""Pack3DAttention layer: impls agree, repacking invariance of axial RoPE (and its absence
for the packed-index baselines), options and bad configuration."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxops import packing
from models.pack3d import Pack3DAttention
from tests import kernel_checks
from tests.test_pack3d import BLOCK, COORDS, FIELD_IDS

D_MODEL, HEADS = 24, 2  # head dim 12, divisible by 6
X = jax.random.normal(jax.random.key(0), COORDS.shape[:2] + (D_MODEL,))


def layer(**kwargs):
  return Pack3DAttention(D_MODEL, HEADS, block_shape=BLOCK, rngs=nnx.Rngs(0), **kwargs)


def run(module, x=X, coords=COORDS, field_ids=FIELD_IDS):
  """The layer under jit with concrete (closed-over) coords."""
  return nnx.jit(lambda m, x: m(x, coords, field_ids))(module, x)


def test_impls_agree():
  out = {impl: run(layer(impl=impl)) for impl in ("pallas", "xla", "reference")}
  assert out["reference"].shape == X.shape
  for impl in ("pallas", "xla"):
    kernel_checks.assert_close(out[impl], out["reference"], rtol=1e-5, name=impl)


def test_gated_merge_and_rotate_after_compression():
  kwargs = dict(merge="gated", rotate_summaries="after", block_bias=False, radius_blocks=0)
  kernel_checks.assert_close(run(layer(impl="xla", **kwargs)),
                             run(layer(impl="reference", **kwargs)), rtol=1e-5)


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
