"""Pack3D's multi-level far field (DESIGN.md section 3.1): the cubes of levels 2..L, their
summaries, and which of them a query cube attends to.

A level-k cube is 2 x 2 x 2 level-(k-1) cubes: its index per axis is c_k = c_1 >> (k - 1) for
the level-1 cube index c_1 (coordinates are non-negative). A query cube a attends, besides its
level-1 neighbourhood (radius r_1, exact tokens), to the level-k cubes b with

    Far_k(a) = { b non-empty, same field : d_k(a, b) > r_k and (k = L or d_{k+1}(a, parent(b)) <= r_{k+1}) }

where d_k is the Chebyshev distance of level-k indices and parent(b) = b >> 1. With
r_{k+1} >= ceil(r_k / 2) every key token is counted exactly once over Loc and Far_1..Far_L
(the counting argument is in the design document). Summaries are token means (the
count-weighted mean of the children's means), logits get log(n_b) and the level's offset.

Slots: the level-k cubes of a field take the z-major slots of the field's level-k bounding
box, after the fields before it (as level 1 does in `pack3d_layout`). A field's level-k box
is never larger than its level-1 box, so C level-1 slots bound the level-k slots too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxops.pack3d_layout import MAX_FIELDS

_F32 = jnp.float32


def level_radii(radius_blocks: int, levels: int, level_radius=None) -> tuple[int, ...]:
  """(r_1, ..., r_L): r_1 = radius_blocks, the others from `level_radius` (an int for every
  level >= 2, a sequence of L - 1 ints, or None: radius_blocks). ValueError unless every
  r_k >= 0 and r_{k+1} >= ceil(r_k / 2) (else a key would be counted twice or not at all)."""
  if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
    raise ValueError(f"pack3d_attention: `levels` must be an int >= 1, got {levels!r}")
  if level_radius is None:
    rest = [radius_blocks] * (levels - 1)
  elif isinstance(level_radius, int):
    rest = [level_radius] * (levels - 1)
  else:
    rest = list(level_radius)
    if len(rest) != levels - 1:
      raise ValueError(f"pack3d_attention: `level_radius` needs levels - 1 = {levels - 1} "
                       f"entries, got {level_radius!r}")
  radii = tuple(int(r) for r in (radius_blocks, *rest))
  for k, r in enumerate(radii, 1):
    if r < 0:
      raise ValueError(f"pack3d_attention: the level-{k} radius must be >= 0, got {r}")
    if k < levels and radii[k] < math.ceil(r / 2):
      raise ValueError(f"pack3d_attention: the level-{k + 1} radius {radii[k]} is below "
                       f"ceil(r_{k} / 2) = {math.ceil(r / 2)} (`level_radius`): keys would be "
                       f"counted twice or missed")
  return radii


def offsets_per_level(far_offset, levels: int, heads: int):
  """beta as float32 [L, H] (an [H] offset is every level's), or None."""
  if far_offset is None:
    return None
  beta = jnp.asarray(far_offset, _F32)
  if beta.shape == (heads,):
    return jnp.broadcast_to(beta, (levels, heads))
  if beta.shape == (levels, heads):
    return beta
  raise ValueError(f"pack3d_attention: `far_offset` has shape {beta.shape}; expected [H] = "
                   f"({heads},) or [levels, H] = ({levels}, {heads})")


def _chebyshev(a, b):
  """max over the 3 axes of |a - b| for broadcastable [..., 3] int arrays, an axis at a time."""
  d = jnp.abs(a[..., 0] - b[..., 0])
  for axis in (1, 2):
    d = jnp.maximum(d, jnp.abs(a[..., axis] - b[..., axis]))
  return d


def _level_cubes(keys, count, summary, level: int):
  """One batch entry's level-`level` cubes from its level-1 cubes.

  keys int [C, 4] (field, cz, cy, cx), count float [C], summary: (kbar, vbar) [C, H, D] each.
  Returns keys_k [C, 4] (-1 for unused slots), count_k [C], (kbar_k, vbar_k)."""
  slots = keys.shape[0]
  used = count > 0
  field = jnp.clip(keys[:, 0], 0, MAX_FIELDS - 1)
  cube = jnp.right_shift(jnp.maximum(keys[:, 1:], 0), level - 1)           # [C, 3]
  member = (field[:, None] == jnp.arange(MAX_FIELDS)) & used[:, None]     # [C, F]
  present = jnp.any(member, axis=0)
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.stack([jnp.min(jnp.where(member, cube[:, a:a + 1], big), axis=0) for a in range(3)], 1)
  hi = jnp.stack([jnp.max(jnp.where(member, cube[:, a:a + 1], -1), axis=0) for a in range(3)], 1)
  lo = jnp.where(present[:, None], lo, 0)
  extent = jnp.where(present[:, None], hi - lo + 1, 0)                    # [F, 3]
  volume = extent[:, 0] * extent[:, 1] * extent[:, 2]
  start = jnp.cumsum(volume) - volume
  rel = cube - lo[field]
  slot = start[field] + (rel[:, 0] * extent[field, 1] + rel[:, 1]) * extent[field, 2] + rel[:, 2]
  slot = jnp.where(used, slot, slots)                                    # unused: dropped
  count_k = jax.ops.segment_sum(count, slot, slots)
  key = jnp.concatenate([field[:, None], cube], axis=1)
  keys_k = jax.ops.segment_max(jnp.where(used[:, None], key, -1), slot, slots)
  keys_k = jnp.where((count_k > 0)[:, None], keys_k, -1)
  inv = 1.0 / jnp.maximum(count_k, 1.0)[:, None, None]
  means = tuple(jax.ops.segment_sum(count[:, None, None] * s, slot, slots) * inv for s in summary)
  return keys_k, count_k, means


def far_summaries(keys, count, kbar, vbar, levels: int):
  """Every level's cubes, stacked: keys [B, L, C, 4], count [B, L, C], kbar, vbar
  [B, L, C, H, D] (level 1 first: the layout's own cubes and summaries)."""
  def one_entry(keys, count, kbar, vbar):
    out = [(keys, count, (kbar, vbar))]
    out += [_level_cubes(keys, count, (kbar, vbar), k) for k in range(2, levels + 1)]
    stack = lambda f: jnp.stack([f(o) for o in out])
    return (stack(lambda o: o[0]), stack(lambda o: o[1]), stack(lambda o: o[2][0]),
            stack(lambda o: o[2][1]))
  return jax.vmap(one_entry)(keys, count, kbar, vbar)


def far_masks(query_keys, keys, count, radii):
  """bool [c, L, C]: level-k cube b (keys[k-1, b]) is in Far_k of the query cube with level-1
  key query_keys[a] ([c, 4]); keys [L, C, 4], count [L, C] as from `far_summaries`."""
  levels = len(radii)
  masks = []
  for k in range(1, levels + 1):
    key = keys[k - 1]
    q_cube = jnp.right_shift(jnp.maximum(query_keys[:, 1:], 0), k - 1)[:, None]    # [c, 1, 3]
    far = ((query_keys[:, None, 0] == key[None, :, 0]) & (count[k - 1] > 0)[None]
           & (_chebyshev(q_cube, key[None, :, 1:]) > radii[k - 1]))
    if k < levels:
      parent = jnp.right_shift(jnp.maximum(key[None, :, 1:], 0), 1)
      far &= _chebyshev(jnp.right_shift(q_cube, 1), parent) <= radii[k]
    masks.append(far)
  return jnp.stack(masks, axis=1)
