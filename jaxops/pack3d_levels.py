"""Pack3D's multi-level far field (DESIGN.md section 3.1): the cubes of levels 2..L, their
summaries, and which of them a query cube attends to.

A level-k cube is 2 x 2 x 2 level-(k-1) cubes: its index per axis is c_k = c_1 >> (k - 1) for
the level-1 cube index c_1 (coordinates are non-negative). A query cube a attends, besides its
level-1 neighbourhood (radius r_1, exact tokens), to the level-k cubes b with

    Far_k(a) = { b non-empty, same field : d_k(a, b) > r_k and (k = L or d_{k+1}(a, parent(b)) <= r_{k+1}) }

where d_k is the Chebyshev distance of level-k indices and parent(b) = b >> 1. With
r_{k+1} >= ceil(r_k / 2) every key token is counted exactly once over Loc and Far_1..Far_L
(the counting argument is in the design document). Summaries are token means (the
count-weighted mean of the children's means), logits get log(n_b) and the level's offset; a
level-k summary's key is scaled by g^(k-1) (`level_key_gain` g, default `KEY_GAIN` = 8: a
feature that fills one level-1 cube keeps the key term of its level-1 logit; 1 keeps the
counting argument exact).

Slots: the level-k cubes of a field take the z-major slots of the field's level-k bounding
box, after the fields before it (as level 1 does in `pack3d_layout`). A field's level-k box
is never larger than its level-1 box, so C level-1 slots bound the level-k slots too.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.pack3d_layout import MAX_FIELDS, cube_distance

_F32 = jnp.float32
# The default level_key_gain, the rule and its measurement in DESIGN.md section 3.1: a level-k
# cube holds 8^(k-1) level-1 cubes, so 8^(k-1) gives a feature that fills one of them back the
# key term of its own level-1 summary's logit.
KEY_GAIN = 8.0
# Pack3DAttention's options that only exist with levels >= 2 (a caller building the single-level
# or local-only twin of a multi-level layer drops them).
OPTIONS = ("levels", "level_radius", "max_top_cubes", "level_key_gain")


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
      name = "`radius_blocks`" if k == 1 else "`level_radius`"
      raise ValueError(f"pack3d_attention: {name}: the level-{k} radius must be >= 0, got {r}")
    if k < levels and radii[k] < math.ceil(r / 2):
      raise ValueError(f"pack3d_attention: the level-{k + 1} radius {radii[k]} is below "
                       f"ceil(r_{k} / 2) = {math.ceil(r / 2)} (`level_radius`): keys would be "
                       f"counted twice or missed")
  return radii


def check_level_options(levels: int, max_top_cubes, level_key_gain: float | None = None, *,
                        owner: str = "pack3d_attention", **single_level) -> float:
  """One-line ValueErrors shared by the XLA path, the kernels and the layer (`owner` names
  the caller): `max_top_cubes` (a positive int) and `level_key_gain` (a real number > 0,
  finite in float32) only with levels >= 2, the single-level options given (not None) only
  with levels = 1. Returns the key gain (None: `KEY_GAIN`)."""
  if level_key_gain is not None and (
      isinstance(level_key_gain, bool) or not isinstance(level_key_gain, numbers.Real)
      or not 0 < level_key_gain < float(np.finfo(np.float32).max)):
    raise ValueError(f"{owner}: `level_key_gain` must be a number > 0 and finite in float32, "
                     f"got {level_key_gain!r}")
  if levels == 1:
    for name, value in (("max_top_cubes", max_top_cubes), ("level_key_gain", level_key_gain)):
      if value is not None:
        raise ValueError(f"{owner}: `{name}` is a multi-level option (levels >= 2); "
                         f"got {name}={value} with levels=1")
    return 1.0
  for name, value in single_level.items():
    if value is not None:
      raise ValueError(f"{owner}: `{name}` is a single-level option (single-level "
                       f"options need levels=1); got levels={levels}")
  checks.ints(owner, checks.given(max_top_cubes=max_top_cubes))
  return KEY_GAIN if level_key_gain is None else float(level_key_gain)


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


def _box(keys, count, level: int):
  """Every field's level-`level` bounding box over one batch entry's used level-1 cubes
  (keys int [C, 4], count [C]): (lo [F, 3], extent [F, 3], start [F]), start the first slot of
  the field's cubes (fields in id order, each box z-major; level 1 gives the layout's slots)."""
  used = count > 0
  field = jnp.clip(keys[:, 0], 0, MAX_FIELDS - 1)
  cube = jnp.right_shift(jnp.maximum(keys[:, 1:], 0), level - 1)           # [C, 3]
  member = (field[:, None] == jnp.arange(MAX_FIELDS)) & used[:, None]     # [C, F]
  present = jnp.any(member, axis=0)
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.stack([jnp.min(jnp.where(member, cube[:, a:a + 1], big), axis=0) for a in range(3)], 1)
  hi = jnp.stack([jnp.max(jnp.where(member, cube[:, a:a + 1], -1), axis=0) for a in range(3)], 1)
  lo = jnp.where(present[:, None], lo, 0)
  extent = jnp.where(present[:, None], hi - lo + 1, 0)
  volume = extent[:, 0] * extent[:, 1] * extent[:, 2]
  return lo, extent, jnp.cumsum(volume) - volume


def _slot(box, field, cube):
  """Slot of the level cube `cube` [..., 3] of `field` [...] in `box`, and whether the cube
  lies inside the field's box (outside: slot 0, to be masked)."""
  lo, extent, start = box
  rel = cube - lo[field]
  ext = extent[field]
  inside = jnp.all((rel >= 0) & (rel < ext), axis=-1)
  slot = start[field] + (rel[..., 0] * ext[..., 1] + rel[..., 1]) * ext[..., 2] + rel[..., 2]
  return jnp.where(inside, slot, 0), inside


def _level_cubes(keys, count, summary, level: int):
  """One batch entry's level-`level` cubes from its level-1 cubes.

  keys int [C, 4] (field, cz, cy, cx), count float [C], summary: (kbar, vbar) [C, H, D] each.
  Returns keys_k [C, 4] (-1 for unused slots), count_k [C], (kbar_k, vbar_k), box."""
  slots = keys.shape[0]
  used = count > 0
  box = _box(keys, count, level)
  field = jnp.clip(keys[:, 0], 0, MAX_FIELDS - 1)
  cube = jnp.right_shift(jnp.maximum(keys[:, 1:], 0), level - 1)
  slot = jnp.where(used, _slot(box, field, cube)[0], slots)              # unused: dropped
  count_k = jax.ops.segment_sum(count, slot, slots)
  key = jnp.concatenate([field[:, None], cube], axis=1)
  keys_k = jax.ops.segment_max(jnp.where(used[:, None], key, -1), slot, slots)
  keys_k = jnp.where((count_k > 0)[:, None], keys_k, -1)
  inv = 1.0 / jnp.maximum(count_k, 1.0)[:, None, None]
  means = tuple(jax.ops.segment_sum(count[:, None, None] * s, slot, slots) * inv for s in summary)
  return keys_k, count_k, means, box


def candidates(query_keys, box, level: int, radius: int, radius_up: int):
  """Far_level of each query cube for a level below the top, read from the children of the
  level+1 cubes within radius_up of the query's: (slots [c, K], far [c, K]), K = 8
  (2 radius_up + 1)^3; `far` says the slot is a cube of the query's field box at distance >
  `radius` (non-emptiness is the caller's test). query_keys int [c, 4] (level-1 keys)."""
  offsets = np.stack(np.meshgrid(*[np.arange(-radius_up, radius_up + 1)] * 3, indexing="ij"),
                     -1).reshape(-1, 3)
  children = np.stack(np.meshgrid(*[np.arange(2)] * 3, indexing="ij"), -1).reshape(-1, 3)
  steps = (2 * offsets[:, None] + children[None]).reshape(-1, 3)          # [K, 3]
  field = jnp.clip(query_keys[:, 0], 0, MAX_FIELDS - 1)
  own = jnp.right_shift(jnp.maximum(query_keys[:, 1:], 0), level - 1)     # [c, 3]
  cube = 2 * jnp.right_shift(own, 1)[:, None] + jnp.asarray(steps)[None]  # [c, K, 3]
  slots, inside = _slot(box, field[:, None], cube)
  return slots, inside & (cube_distance(cube, own[:, None]) > radius)


def level_structure(keys, count, kbar, vbar, levels: int, key_gain: float):
  """One batch entry's cubes of every level, for `candidates` (levels below the top) and the
  top level's masks. Returns a list over k = 1..L of (keys_k [C, 4], count_k [C],
  kbar_k, vbar_k [C, H, D], box_k); level 1 is the layout's own cubes. kbar_k is the token
  mean of the level-k cube's keys times key_gain^(k-1) (DESIGN.md 3.1, `level_key_gain`)."""
  out = [(keys, count, kbar, vbar, _box(keys, count, 1))]
  for k in range(2, levels + 1):
    keys_k, count_k, (kbar_k, vbar_k), box = _level_cubes(keys, count, (kbar, vbar), k)
    out.append((keys_k, count_k, kbar_k * key_gain ** (k - 1), vbar_k, box))
  return out


def top_slots(keys, count, levels: int, bound: int | None = None) -> int:
  """Slots the top level needs over the batch (keys int [B, C, 4], count [B, C]): its boxes'
  total volume when the layout is concrete (known at trace time), else `bound` (default C,
  which fits any layout; `poison_top_overflow` flags an entry that needs more)."""
  if isinstance(keys, jax.core.Tracer) or isinstance(count, jax.core.Tracer):
    return min(bound or keys.shape[1], keys.shape[1])
  with jax.ensure_compile_time_eval():  # inside a jit trace too
    return max(1, int(jnp.max(jax.vmap(lambda k, c: _box_volume(k, c, levels))(keys, count))))


def level_slots(keys, count, levels: int, max_top_cubes: int | None = None) -> tuple[int, ...]:
  """Slots of levels 2..L for tables that hold every cube of a level (the kernels' summary
  stream). Concrete layouts: each level's exact box volume (`top_slots`). Traced ones: the
  top level's `top_slots(..., max_top_cubes)` = M_L, and min(C, 8^(L-k) M_L) for k < L: per
  axis a field's level-k box is at most twice as long as its level-(k+1) box (lo_k >=
  2 lo_{k+1}, hi_k <= 2 hi_{k+1} + 1), so whenever the top level fits (else `poison_top_overflow`
  makes the entry NaN) level k fits too."""
  top = top_slots(keys, count, levels, max_top_cubes)
  below = lambda k: top_slots(keys, count, k, min(keys.shape[1], 8 ** (levels - k) * top))
  return tuple(below(k) for k in range(2, levels)) + (top,)


def _box_volume(keys, count, level: int):
  """Slots of one batch entry's level-`level` boxes (all fields)."""
  return jnp.sum(jnp.prod(_box(keys, count, level)[1], axis=-1))


def poison_top_overflow(o, keys, count, levels: int, slots: int):
  """o [B, ...] with NaN in the entries whose top-level boxes need more than `slots` slots
  (traced coords with too small a `max_top_cubes`: their cubes past the slots were dropped),
  as `pack3d_layout.poison_overflow` does for a level-1 overflow."""
  over = jax.vmap(lambda k, c: _box_volume(k, c, levels) > slots)(keys, count)
  return jnp.where(over.reshape((-1,) + (1,) * (o.ndim - 1)), jnp.nan, o)


def top_mask(query_keys, keys, count, level: int, radius: int):
  """bool [c, M]: the top-level cube b (keys [M, 4], count [M]) is in Far_L of the query cube
  with level-1 key query_keys[a]: same field, non-empty, distance > radius (no level above)."""
  own = jnp.right_shift(jnp.maximum(query_keys[:, 1:], 0), level - 1)[:, None]
  return ((query_keys[:, None, 0] == keys[None, :, 0]) & (count > 0)[None]
          & (cube_distance(own, keys[None, :, 1:]) > radius))
