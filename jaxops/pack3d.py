"""Pack3D attention: exact local attention plus attention over cube summaries, one softmax.

Shapes: q, k, v [B, N, H, D] (q and k already rotated, e.g. by `jaxops.rope.axial_rope_3d`),
coords int [B, N, 3] (z, y, x) of each token in its field, field_ids int [B, N]. Tokens
may be packed in any order; the packed index never enters the math.

Each field is tiled into cubes of `block_shape`; token i lies in cube
c(i) = floor(p_i / block_shape). For query i, within its own field (r = radius_blocks)::

  Loc(i) = { tokens j : max|c(j) - c(i)| <= r }                  exact token attention
  Far(i) = { cubes b : max|b - c(i)| > r, b not empty }          one summary per cube
  kbar_b = mean_{j in b} k_j ,  vbar_b = mean_{j in b} v_j ,  n_b = |b|
  s_ij = q_i . k_j / sqrt(D) ;  s_ib = q_i . kbar_b / sqrt(D) + log(n_b) + beta_h
  o_i  = (sum_{Loc} e^{s_ij} v_j + sum_{Far} e^{s_ib} vbar_b) / Z_i       (one softmax)

With the log(n_b) bias (`block_bias`, on by default) and beta = 0, a cube of identical
keys contributes exactly what its tokens would under full attention. beta_h is the
optional per-head `far_offset` [H] (None: no offset), a learnable shift of every far
logit of head h (added to 0 with `block_bias=False`), differentiable:
d beta_h = sum over queries and their far cubes of the far logits' cotangent.
Options: `block_bias=False`; `gates` [B, N, H, 2] for the
NSA-style gated merge o = g_0 softmax_Loc(...) + g_1 softmax_Far(...) of two separately
normalized branches (a query without far cubes gets 0 from the far branch; there a
per-head `far_offset` cancels inside softmax_Far, so it changes nothing and its gradient
is 0 up to rounding); `summary_rope` for summaries rotated after compression (the
ablation): keys are un-rotated, averaged, and the mean rotated at the cube's mean position.

`pack3d_attention_reference` is dense and masked (O(N^2)); `pack3d_attention` sorts the
tokens cube-major, gathers the <= (2r+1)^3 neighbour cubes of each query cube and
attends to them and to all far summaries (cost per query (2r+1)^3 T + C for T tokens
per cube and C cubes), in chunks of query cubes recomputed in the backward. Both give
the same result. The Pallas kernel (`pallas_kernels.pack3d_attention`) shares
`cube_layout` and `cube_summaries` with the XLA path.

Static structure: under `jit` the number of cubes C must be static. Concrete
coords/field_ids (numpy, or jax arrays closed over by the jitted function) give the
exact cube structure at trace time; traced ones use the static `max_cubes` (default
`default_max_cubes(N, block_shape)`) and mask the unused slots. Both give the same
result; only the cost differs. Coordinates must be unique within a field. With traced
coords, a batch entry with more cubes than slots or with negative coords cannot raise
from a compiled program: its output is NaN (so a training run stops on it), and
`layout_status` tells the caller which entries and why. No host callback: the same
function compiles for TPU and GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxops import checks
from jaxops.rope import axial_rope_3d_float

_F32 = jnp.float32
MASK = -1e30  # finite "minus infinity": fully masked rows stay finite (and are discarded)


# ----------------------------------------------------------------------------- checks

def check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks,
                        gates=None, far_offset=None) -> None:
  """Raises (see `jaxops.checks`) naming the argument when shapes, dtypes or values do not fit.

  Concrete coords must be non-negative and unique within a field; with traced coords an
  entry that breaks this gets NaN outputs and a nonzero `layout_status` instead."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"pack3d_attention: `{name}` must be [B, N, H, D], got shape {x.shape}")
    checks.floating("pack3d_attention", name, x)
  checks.nonempty("pack3d_attention", "q", q, "[B, N, H, D]")
  for name, x in (("k", k), ("v", v)):
    if x.shape != q.shape:
      raise ValueError(f"pack3d_attention: `{name}` has shape {x.shape}; expected the shape"
                       f" of q {q.shape}")
  batch, n = q.shape[:2]
  if coords.shape != (batch, n, 3):
    raise ValueError(f"pack3d_attention: `coords` has shape {coords.shape}; expected [B, N, 3]"
                     f" = {(batch, n, 3)} from q {q.shape}")
  if field_ids.shape != (batch, n):
    raise ValueError(f"pack3d_attention: `field_ids` has shape {field_ids.shape}; expected"
                     f" [B, N] = {(batch, n)} from q {q.shape}")
  for name, x in (("coords", coords), ("field_ids", field_ids)):
    checks.integer("pack3d_attention", name, x)
  checks.zyx("pack3d_attention", "block_shape", block_shape)
  checks.ints("pack3d_attention", {"radius_blocks": radius_blocks}, minimum=0)
  if gates is not None and gates.shape != q.shape[:3] + (2,):
    raise ValueError(f"pack3d_attention: `gates` has shape {gates.shape}; expected [B, N, H, 2]"
                     f" = {q.shape[:3] + (2,)}")
  if far_offset is not None:
    if jnp.shape(far_offset) != q.shape[2:3]:
      raise ValueError(f"pack3d_attention: `far_offset` has shape {jnp.shape(far_offset)};"
                       f" expected [H] = {q.shape[2:3]} from q {q.shape}")
    checks.floating("pack3d_attention", "far_offset", jnp.asarray(far_offset))
  if not checks.is_traced(coords) and not checks.is_traced(field_ids):
    _check_values(np.asarray(coords), np.asarray(field_ids))


def _check_values(coords: np.ndarray, field_ids: np.ndarray) -> None:
  if coords.size and coords.min() < 0:
    raise ValueError(f"pack3d_attention: `coords` must be non-negative, found {coords.min()}")
  for b in range(coords.shape[0]):
    rows = np.concatenate([field_ids[b, :, None], coords[b]], axis=1)
    if len(np.unique(rows, axis=0)) != len(rows):
      raise ValueError(f"pack3d_attention: `coords` repeat a position within a field"
                       f" (batch entry {b}); each token needs its own (z, y, x)")


# ----------------------------------------------------------------------------- cube layout

def default_max_cubes(num_tokens: int, block_shape: Sequence[int]) -> int:
  """Cube slots used for traced coords: 4 N / prod(block_shape), at most N.

  Enough when fields are not much smaller than a few cubes; pass `max_cubes` otherwise
  (a run with more cubes than slots stops with an error).
  """
  return max(1, min(num_tokens, 4 * math.ceil(num_tokens / math.prod(block_shape))))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot", "count", "keys", "neighbours", "num_neighbours",
                                "overflow"],
                   meta_fields=["slots_per_cube", "radius_blocks"])
@dataclasses.dataclass(frozen=True)
class CubeLayout:
  """Cube-major layout of a batch of packed tokens: C cubes of `slots_per_cube` slots.

  slot            int32 [B, N]     token i sits at slot[b, i] of the flat layout [C * T]
  count           float32 [B, C]   n_b, the tokens in cube b (0: unused slot)
  keys            int32 [B, C, 4]  (field, cz, cy, cx) of each cube (-1 for unused slots),
                                   ascending in that order over the used slots
  neighbours      int32 [B, C, K]  cubes within the radius in the same field, K = min((2r+1)^3,
                                   C); the first num_neighbours are the set, the rest repeat
                                   entry 0 (never read as keys)
  num_neighbours  int32 [B, C]
  overflow        bool [B]         traced coords only: the entry needs more than C cubes or
                                   has negative coords (its outputs are NaN, see `cube_layout`)

  Far cubes are not stored (C^2 of them): `far(rows)` derives them from `keys`.
  """

  slot: jax.Array
  count: jax.Array
  keys: jax.Array
  neighbours: jax.Array
  num_neighbours: jax.Array
  overflow: jax.Array
  slots_per_cube: int
  radius_blocks: int

  @property
  def num_cubes(self) -> int:
    return self.count.shape[1]

  def to_cubes(self, x):
    """[B, N, ...] -> [B, C, T, ...], empty slots zero."""
    b, n = x.shape[:2]
    flat = jnp.zeros((b, self.num_cubes * self.slots_per_cube) + x.shape[2:], x.dtype)
    flat = jax.vmap(lambda f, s, v: f.at[s].set(v))(flat, self.slot, x)
    return flat.reshape(b, self.num_cubes, self.slots_per_cube, *x.shape[2:])

  def from_cubes(self, x):
    """Inverse of `to_cubes`: [B, C, T, ...] -> [B, N, ...]."""
    flat = x.reshape(x.shape[0], -1, *x.shape[3:])
    return jax.vmap(lambda f, s: f[s])(flat, self.slot)

  def key_valid(self):
    """bool [B, C, T]: slot holds a token."""
    # int32, not bool: TPU compiles an element-wise bool scatter ~8x slower (12 s at 65k)
    return self.to_cubes(jnp.ones(self.slot.shape, jnp.int32)) > 0

  def far(self, rows=None):
    """bool [B, R, C]: far[b, r, c] says cube c is a far summary for query cube rows[r]
    (all C cubes when rows is None): same field, Chebyshev cube distance > radius, used."""
    query = self.keys if rows is None else self.keys[:, rows]
    return is_far(query[:, :, None], self.keys[:, None], self.count[:, None] > 0,
                  self.radius_blocks)

  def cube_rows(self):
    """float32 [B, 8, C]: rows field, cz, cy, cx, count (then zeros) of every cube, for the
    kernels' far test (exact in float32 below 2^24)."""
    rows = jnp.concatenate([self.keys.astype(_F32), self.count[..., None],
                            jnp.zeros(self.count.shape + (3,), _F32)], axis=-1)
    return jnp.swapaxes(rows, 1, 2)


def is_far(query_keys, keys, used, radius: int):
  """Far test on broadcastable [..., 4] cube keys (field, cz, cy, cx): same field, cube
  distance max_a |c_a - q_a| > radius, and `used`. One axis at a time, so nothing
  [..., 3]-shaped is built (a TPU would pad that 3 to 128 lanes)."""
  distance = jnp.abs(keys[..., 1] - query_keys[..., 1])
  for a in (2, 3):
    distance = jnp.maximum(distance, jnp.abs(keys[..., a] - query_keys[..., a]))
  return (keys[..., 0] == query_keys[..., 0]) & (distance > radius) & used


# Cube slots come from each field's bounding box of cubes: slot = field offset + the cube's
# z-major index in the box. No sort (TPU sort compile time grows with its size: 80-140 s
# for the 1M tokens of 4 x 262k), and neighbours are arithmetic. A field whose cubes do not
# fill their box (not a dense grid) leaves empty slots (count 0), which cost slots only.
MAX_FIELDS = 256  # field ids per batch entry: [0, MAX_FIELDS)


def _layout_one(coords, field_ids, *, block_shape, radius_blocks, num_cubes, slots):
  """CubeLayout fields for one batch entry (coords [N, 3], field_ids [N]).

  Everything is computed per axis on [N]- or [C]-shaped arrays: an [N, 3] intermediate
  takes 128 lanes per row on TPU (512 MiB for the 1M coordinates of 4 x 262k tokens)."""
  field = field_ids.astype(jnp.int32)
  axes = [coords[:, a].astype(jnp.int32) for a in range(3)]             # z, y, x: [N] each
  cube = [c // b for c, b in zip(axes, block_shape)]
  local = [c % b for c, b in zip(axes, block_shape)]
  local_index = (local[0] * block_shape[1] + local[1]) * block_shape[2] + local[2]
  fits = (jnp.min(field) >= 0) & (jnp.max(field) < MAX_FIELDS)
  seg = jnp.clip(field, 0, MAX_FIELDS - 1)
  # Per-field boxes as masked reductions over a fused [N, F] membership test, not
  # segment_min/max: TPU compiles element-wise scatter-min/max (and float scatter-add)
  # through a path whose compile time grows with N (~11 s each at 65k tokens on v6e).
  member = seg[:, None] == jnp.arange(MAX_FIELDS, dtype=jnp.int32)      # [N, F], fused
  present = jnp.any(member, axis=0)[:, None]                            # [F, 1]
  big = jnp.iinfo(jnp.int32).max
  lo = jnp.where(present, jnp.stack(
      [jnp.min(jnp.where(member, c[:, None], big), axis=0) for c in cube], 1), 0)   # [F, 3]
  hi = jnp.stack([jnp.max(jnp.where(member, c[:, None], -1), axis=0) for c in cube], 1)
  extent = jnp.where(present, hi - lo + 1, 0)
  volume = extent[:, 0] * extent[:, 1] * extent[:, 2]                   # [F] cubes per box
  end = jnp.cumsum(volume)
  start = end - volume

  def slot_of(f, z, y, x):  # cube coords of field f -> slot (unchecked)
    rel = [c - lo[f, a] for a, c in enumerate((z, y, x))]
    return start[f] + (rel[0] * extent[f, 1] + rel[1]) * extent[f, 2] + rel[2]

  cube_id = slot_of(seg, *cube)
  # int32 counts: a float32 element scatter-add compiles like scatter-min on TPU (above)
  count = jnp.zeros(num_cubes, jnp.int32).at[cube_id].add(1, mode="drop").astype(_F32)
  # Each slot's key (field, cz, cy, cx), decoded from its position in its field's box.
  ids = jnp.arange(num_cubes, dtype=jnp.int32)
  f = jnp.minimum(jnp.searchsorted(end, ids, side="right"), MAX_FIELDS - 1)
  rel = ids - start[f]
  ey, ex = jnp.maximum(extent[f, 1], 1), jnp.maximum(extent[f, 2], 1)
  zyx = (rel // (ey * ex) + lo[f, 0], (rel // ex) % ey + lo[f, 1], rel % ex + lo[f, 2])
  cube_keys = jnp.where((count > 0)[:, None], jnp.stack([f, *zyx], axis=1), -1)
  # Neighbours: every offset in [-r, r]^3 inside the field's box, if that cube has tokens.
  # One [C, K] array per axis: a trailing axis of 3 would be padded to 128 lanes on TPU.
  r = radius_blocks
  offsets = np.stack(np.meshgrid(*[np.arange(-r, r + 1)] * 3, indexing="ij"), -1).reshape(-1, 3)
  target = [c[:, None] + jnp.asarray(offsets[:, a]) for a, c in enumerate(zyx)]   # [C, K]
  inside = functools.reduce(jnp.logical_and, [
      (t >= lo[f, a][:, None]) & (t < (lo + extent)[f, a][:, None]) for a, t in enumerate(target)])
  index = jnp.clip(slot_of(f[:, None], *target), 0, num_cubes - 1)
  found = inside & (count[index] > 0) & (count[:, None] > 0)             # [C, K]
  # Compact the found ones to the front of each row (a scatter, not a sort).
  k = min(len(offsets), num_cubes)
  position = jnp.where(found, jnp.cumsum(found, axis=1) - 1, k)
  rows = jnp.broadcast_to(ids[:, None], found.shape)
  neighbours = jnp.zeros((num_cubes, k), jnp.int32).at[rows, position].set(index, mode="drop")
  num_neighbours = jnp.sum(found, axis=1, dtype=jnp.int32)
  neighbours = jnp.where(jnp.arange(k) < num_neighbours[:, None], neighbours, neighbours[:, :1])
  negative = functools.reduce(jnp.minimum, [jnp.min(c) for c in axes]) < 0
  status = jnp.where(negative, -1,
                     jnp.where(~fits, -2, jnp.where(end[-1] > num_cubes, end[-1], 0)))
  return dict(slot=cube_id * slots + local_index, count=count, keys=cube_keys,
              neighbours=neighbours, num_neighbours=num_neighbours, status=status)


def _num_slots(coords: np.ndarray, field_ids: np.ndarray, block_shape) -> int:
  """The slots concrete coords need: the most, over batch entries, of the summed cube
  bounding-box volumes of their fields."""
  most = 1
  for c, f in zip(coords // np.asarray(block_shape), field_ids):
    most = max(most, sum(int(np.prod(c[f == i].max(0) - c[f == i].min(0) + 1))
                         for i in np.unique(f)))
  return most


@functools.partial(jax.jit, static_argnames=("block_shape", "radius_blocks", "num_cubes", "slots"))
def _build_layout(coords, field_ids, **static):
  """`_layout_one` over the batch, as one compiled call (also when run eagerly); a loop
  over batch entries (vmap's batched scatters compiled 4x slower for TPU)."""
  return jax.lax.map(lambda cf: _layout_one(*cf, **static), (coords, field_ids))


def cube_layout(coords, field_ids, *, block_shape=(4, 4, 4), radius_blocks: int = 1,
                max_cubes: int | None = None, slots_per_cube: int | None = None) -> CubeLayout:
  """The cube structure of a batch of packed tokens (see `CubeLayout`).

  Slots: each field gets the cubes of its bounding box (z-major), so C is the summed box
  volume (the cube count itself for fields that are dense grids; a box's empty cubes are
  unused slots). Concrete coords/field_ids: exact C (the most of any batch entry),
  computed at trace time. Traced: C = max_cubes (default `default_max_cubes`); an entry that needs
  more cubes, or has negative coords, is flagged in `overflow` (the ops return NaN for
  it; `layout_status` reports it to the caller) since a compiled program cannot raise.
  `slots_per_cube` >= prod(block_shape) pads each cube (kernels want aligned slabs).
  """
  checks.ints("pack3d_attention", checks.given(max_cubes=max_cubes))
  block_shape = tuple(int(b) for b in block_shape)
  slots = slots_per_cube or math.prod(block_shape)
  if slots < math.prod(block_shape):
    raise ValueError(f"cube_layout: `slots_per_cube` ({slots}) < prod(block_shape)"
                     f" ({math.prod(block_shape)})")
  build = functools.partial(_build_layout, block_shape=block_shape,
                            radius_blocks=radius_blocks, slots=slots)
  if checks.is_traced(coords) or checks.is_traced(field_ids):
    num_cubes = max_cubes or default_max_cubes(coords.shape[1], block_shape)
    fields = build(coords, field_ids, num_cubes=num_cubes)
  else:
    c, f = np.asarray(coords), np.asarray(field_ids)
    if f.size and (f.min() < 0 or f.max() >= MAX_FIELDS):
      raise ValueError(f"pack3d_attention: `field_ids` must lie in [0, {MAX_FIELDS}), got"
                       f" [{f.min()}, {f.max()}]")
    num_cubes = _num_slots(c, f, block_shape)
    with jax.ensure_compile_time_eval():
      fields = build(jnp.asarray(c), jnp.asarray(f), num_cubes=num_cubes)
  status = fields.pop("status")
  return CubeLayout(**fields, overflow=status != 0, slots_per_cube=slots,
                    radius_blocks=radius_blocks)


def layout_status(coords, field_ids, *, block_shape=(4, 4, 4), max_cubes: int | None = None):
  """int32 [B]: 0 where the entry fits the traced-coords layout; else the number of cube
  slots it needs (more than max_cubes), -1 for negative coords, or -2 for field ids outside
  [0, MAX_FIELDS). Traceable: a train step can return it with its metrics and the caller
  stop on a nonzero entry."""
  block_shape = tuple(int(b) for b in block_shape)
  num_cubes = max_cubes or default_max_cubes(coords.shape[1], block_shape)
  return _build_layout(coords, field_ids, block_shape=block_shape, radius_blocks=0,
                       num_cubes=num_cubes, slots=math.prod(block_shape))["status"]


def poison_overflow(layout: CubeLayout, o):
  """o [B, ...] with NaN in the batch entries whose layout overflowed (never silent)."""
  bad = layout.overflow.reshape((-1,) + (1,) * (o.ndim - 1))
  return jnp.where(bad, jnp.nan, o)


def cube_summaries(layout: CubeLayout, k_cubes, v_cubes, coords=None, summary_rope=None):
  """Cube means kbar, vbar [B, C, H, D] (float32) from k, v in cube layout [B, C, T, H, D].

  summary_rope=None: kbar_b = mean_j k_j (keys rotated before compression). A dict of
  `axial_rope_3d` keywords (theta, spacing): kbar_b = R(pbar_b) mean_j R(-p_j) k_j with
  pbar_b the cube's mean position (rotated after compression; needs `coords`).
  """
  inv_n = 1.0 / jnp.maximum(layout.count, 1.0)[:, :, None, None]
  k32 = k_cubes.astype(_F32)
  if summary_rope is not None:
    pos = layout.to_cubes(coords.astype(_F32))  # [B, C, T, 3]
    k32 = axial_rope_3d_float(k32, -pos, **summary_rope)
    centre = jnp.sum(pos, axis=2) * inv_n[..., 0]
  kbar = jnp.sum(k32, axis=2) * inv_n
  if summary_rope is not None:
    kbar = axial_rope_3d_float(kbar, centre, **summary_rope)
  vbar = jnp.sum(v_cubes.astype(_F32), axis=2) * inv_n
  return kbar, vbar


# ----------------------------------------------------------------------------- reference

def pack3d_attention_reference(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4),
                               radius_blocks: int = 1, block_bias: bool = True, gates=None,
                               summary_rope=None, far_offset=None):
  """Dense masked float32 form: every query against every token of the batch entry.

  A far cube b is represented once per token j in it, carrying b's summary and the
  weight 1/n_b, so the sum over far cubes is a masked sum over tokens:
  sum_{b in Far} e^{s_ib} vbar_b = sum_{j: c(j) in Far} e^{s_ic(j) - log n_c(j)} vbar_c(j).
  far_offset [H] (optional) is added to every far logit of its head.
  Returns o [B, N, H, D] in q.dtype.
  """
  check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks, gates, far_offset)
  q32, k32, v32 = (x.astype(_F32) for x in (q, k, v))
  cube = coords // jnp.asarray(block_shape, coords.dtype)
  same_field = field_ids[:, :, None] == field_ids[:, None, :]
  distance = jnp.max(jnp.abs(cube[:, :, None] - cube[:, None, :]), axis=-1)
  local = same_field & (distance <= radius_blocks)                     # [B, N, N]
  far = same_field & ~local
  same_cube = (same_field & (distance == 0)).astype(_F32)
  n = jnp.sum(same_cube, axis=-1)                                      # n_c(j), [B, N]
  per_token_mean = lambda x: jnp.einsum("bjl,bl...->bj...", same_cube, x) / n[:, :, None, None]
  if summary_rope is None:
    kbar = per_token_mean(k32)
  else:
    pos = coords.astype(_F32)
    kbar = per_token_mean(axial_rope_3d_float(k32, -pos, **summary_rope))
    centre = jnp.einsum("bjl,bla->bja", same_cube, pos) / n[:, :, None]
    kbar = axial_rope_3d_float(kbar, centre, **summary_rope)
  vbar = per_token_mean(v32)
  scale = 1.0 / math.sqrt(q.shape[-1])
  log_weight = 0.0 if block_bias else -jnp.log(n)[:, None, None, :]  # log n_b - log n_b = 0
  s_loc = jnp.einsum("bihd,bjhd->bhij", q32, k32) * scale
  s_far = jnp.einsum("bihd,bjhd->bhij", q32, kbar) * scale + log_weight
  if far_offset is not None:
    s_far = s_far + jnp.asarray(far_offset, _F32)[None, :, None, None]
  s_loc = jnp.where(local[:, None], s_loc, -jnp.inf)
  s_far = jnp.where(far[:, None], s_far, -jnp.inf)
  if gates is None:
    p = jax.nn.softmax(jnp.concatenate([s_loc, s_far], axis=-1), axis=-1)
    o = jnp.einsum("bhij,bjhd->bihd", p, jnp.concatenate([v32, vbar], axis=1))
  else:
    o_loc = jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s_loc, axis=-1), v32)
    has_far = jnp.any(far, axis=-1)[:, None, :, None]                 # [B, 1, N, 1]
    p_far = jnp.where(has_far, jax.nn.softmax(jnp.where(has_far, s_far, 0.0), axis=-1), 0.0)
    o_far = jnp.einsum("bhij,bjhd->bihd", p_far, vbar)
    g = gates.astype(_F32)
    o = g[..., :1] * o_loc + g[..., 1:] * o_far
  return o.astype(q.dtype)


# ----------------------------------------------------------------------------- XLA path

def _attend_chunk(q, k_cubes, v_cubes, key_valid, kbar, vbar, far_bias, neighbours,
                  num_neighbours, gates, far_offset):
  """Query cubes of one chunk of one batch entry.

  q [c, T, H, D]; k_cubes, v_cubes [C, T, H, D]; key_valid [C, T]; kbar, vbar [C, H, D];
  far_bias [c, C]; neighbours [c, K]; num_neighbours [c]; gates [c, T, H, 2] or None;
  far_offset [H] float32 or None.
  Returns [c, T, H, D] float32.
  """
  c, t, h, d = q.shape
  k_loc = k_cubes[neighbours].reshape(c, -1, h, d)                    # [c, K T, H, D]
  v_loc = v_cubes[neighbours].reshape(c, -1, h, d)
  in_set = jnp.arange(neighbours.shape[1]) < num_neighbours[:, None]  # [c, K]
  valid = (key_valid[neighbours] & in_set[:, :, None]).reshape(c, 1, 1, -1)
  scale = 1.0 / math.sqrt(d)
  s_loc = jnp.einsum("cqhd,ckhd->chqk", q, k_loc, preferred_element_type=_F32) * scale
  s_loc = jnp.where(valid, s_loc, MASK)
  s_far = jnp.einsum("cqhd,bhd->chqb", q.astype(_F32), kbar) * scale + far_bias[:, None, None]
  if far_offset is not None:
    s_far = s_far + far_offset[None, :, None, None]
  pv = lambda p, v_: jnp.einsum("chqk,ckhd->cqhd", p.astype(v_.dtype), v_,
                                preferred_element_type=_F32)
  pvbar = lambda p: jnp.einsum("chqb,bhd->cqhd", p, vbar)
  rows = lambda x: jnp.max(x, axis=-1, keepdims=True)
  total = lambda p: jnp.moveaxis(jnp.sum(p, axis=-1), 1, -1)[..., None]  # [c, T, H, 1]
  if gates is None:
    m = jnp.maximum(rows(s_loc), rows(s_far))
    p_loc, p_far = jnp.exp(s_loc - m), jnp.exp(s_far - m)
    return (pv(p_loc, v_loc) + pvbar(p_far)) / (total(p_loc) + total(p_far))
  p_loc = jnp.exp(s_loc - rows(s_loc))
  is_far = far_bias[:, None, None] > MASK / 2
  p_far = jnp.where(is_far, jnp.exp(s_far - rows(s_far)), 0.0)
  g = gates.astype(_F32)
  o_far = pvbar(p_far) / jnp.maximum(total(p_far), 1e-30)
  return g[..., :1] * pv(p_loc, v_loc) / total(p_loc) + g[..., 1:] * o_far


def pack3d_attention(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4),
                     radius_blocks: int = 1, block_bias: bool = True, gates=None,
                     summary_rope=None, far_offset=None, max_cubes: int | None = None,
                     chunk: int = 16):
  """Fast XLA path of Pack3D attention; same arguments and result as the reference.

  Args (beyond the reference's):
    max_cubes: cube slots for traced coords (see module docstring); ignored otherwise.
    chunk: query cubes per step; each step is `jax.checkpoint`ed, so activation memory
      is O(chunk T (K T + C) H) for K neighbour cubes rather than O(N (K T + C) H).
  Returns:
    o [B, N, H, D] in q.dtype (matmuls in the input dtype, float32 accumulation).
  """
  check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks, gates, far_offset)
  checks.ints("pack3d_attention", {"chunk": chunk})
  offset = None if far_offset is None else jnp.asarray(far_offset, _F32)
  layout = cube_layout(coords, field_ids, block_shape=block_shape, radius_blocks=radius_blocks,
                       max_cubes=max_cubes)
  q_c, k_c, v_c = (layout.to_cubes(x) for x in (q, k, v))
  kbar, vbar = cube_summaries(layout, k_c, v_c, coords, summary_rope)
  g_c = None if gates is None else layout.to_cubes(gates)
  cubes = layout.num_cubes
  chunk = min(chunk, cubes)
  starts = jnp.minimum(jnp.arange(-(-cubes // chunk) * chunk), cubes - 1).reshape(-1, chunk)

  def one_entry(q_c, k_c, v_c, key_valid, kbar, vbar, keys, bias, neighbours, num_nb, g_c):
    def step(ids):  # far cubes of this chunk's query cubes, [chunk, C] (never C x C)
      far = is_far(keys[ids][:, None], keys[None], bias[None] > MASK / 2, radius_blocks)
      return _attend_chunk(q_c[ids], k_c, v_c, key_valid, kbar, vbar,
                           jnp.where(far, bias[None], MASK), neighbours[ids], num_nb[ids],
                           None if g_c is None else g_c[ids], offset)
    o = jax.lax.map(jax.checkpoint(step), starts)
    return o.reshape(-1, *o.shape[2:])[:cubes]

  count = layout.count
  bias = jnp.where(count > 0, jnp.log(jnp.maximum(count, 1.0)) if block_bias else 0.0, MASK)
  o_c = jax.vmap(one_entry)(q_c, k_c, v_c, layout.key_valid(), kbar, vbar, layout.keys, bias,
                            layout.neighbours, layout.num_neighbours, g_c)
  return poison_overflow(layout, layout.from_cubes(o_c)).astype(q.dtype)
