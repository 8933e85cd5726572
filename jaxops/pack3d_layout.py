"""Pack3D's cube layout: packed tokens -> cubes of slots, neighbour lists, far test.

Each field is tiled into cubes of `block_shape`; token i lies in cube
c(i) = floor(p_i / block_shape). `cube_layout` places the tokens cube-major (C cubes of T
slots, `CubeLayout`) and lists each cube's neighbours, the cubes of its field within
`radius_blocks` (Chebyshev distance in cubes); every other used cube of the field is far
(`is_far`). The XLA path (`jaxops.pack3d.pack3d_attention`) and the Pallas kernel
(`pallas_kernels.pack3d_attention`) attend over this same layout; the kernel's TPU operands
store it g slots to a row (`group_rows`, `CubeLayout.to_slot_rows`), so that their rows fill
the 128 lanes a TPU pads each HBM row to.

Static structure: under `jit` the number of cubes C must be static. Concrete
coords/field_ids (numpy, or jax arrays closed over by the jitted function) give the
exact cube structure at trace time; traced ones use the static `max_cubes` (default
`default_max_cubes(N, block_shape)`) and mask the unused slots. Both give the same
result; only the cost differs. With traced coords, a batch entry with more cubes than
slots, field ids outside [0, MAX_FIELDS) or negative coords cannot raise from a compiled
program: the layout flags it (`overflow`), the ops make its output NaN
(`poison_overflow`, so a training run stops on it), and `layout_status` tells the caller
which entries and why. No host callback: the same function compiles for TPU and GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from neurips26_jax.jaxops import checks

_F32 = jnp.float32


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

  def slot_tokens(self):
    """int32 [B, C * T]: the token in each slot (N for an empty slot); the inverse of `slot`."""
    return _tokens_at(self.slot, self.num_cubes * self.slots_per_cube)

  def to_cubes(self, x):
    """[B, N, ...] -> [B, C, T, ...], empty slots zero."""
    flat = permute_rows(x, self.slot_tokens(), self.slot)
    return flat.reshape(x.shape[0], self.num_cubes, self.slots_per_cube, *x.shape[2:])

  def from_cubes(self, x):
    """Inverse of `to_cubes`: [B, C, T, ...] -> [B, N, ...]."""
    flat = x.reshape(x.shape[0], -1, *x.shape[3:])
    return permute_rows(flat, self.slot, self.slot_tokens())

  def to_slot_rows(self, x, groups: int = 1):
    """[B, N, F] -> slot rows [B, C * T / g, g * F] in the order of `group_rows` (g = groups),
    empty slots zero."""
    return _regroup(x, *self._grouped_index(groups), groups, True)

  def from_slot_rows(self, x, groups: int = 1):
    """Inverse of `to_slot_rows`: [B, C * T / g, g * F] -> [B, N, F]."""
    return _regroup(x, *self._grouped_index(groups), groups, False)

  def _grouped_index(self, groups: int):
    """The token in each position of the grouped slots' flat order [B, C * T] (N: empty) and
    the position of each token [B, N] (`_regroup`'s index and position)."""
    # slot c T + j T/g + i sits at c T + i g + j (`group_rows`), computed on the tokens'
    # slots: permuting [B, C * T] index arrays instead compiled ~25 s longer for TPU at 1M
    t = self.slots_per_cube
    cube, j, i = self.slot // t, self.slot % t // (t // groups), self.slot % (t // groups)
    position = cube * t + i * groups + j
    return _tokens_at(position, self.num_cubes * t), position

  def key_valid(self):
    """bool [B, C, T]: slot holds a token."""
    n = self.slot.shape[1]
    return (self.slot_tokens() < n).reshape(-1, self.num_cubes, self.slots_per_cube)

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


def _tokens_at(position, size: int):
  """int32 [B, size]: the token n whose position[b, n] (distinct, < size) it is, else N."""
  b, n = position.shape
  empty = jnp.full((b, size), n, jnp.int32)
  return jax.vmap(lambda e, p: e.at[p].set(jnp.arange(n, dtype=jnp.int32)))(empty, position)


def group_rows(x, t: int, groups: int):
  """Cube slots [B, C * T, F] -> [B, C * T / g, g * F] (g = groups dividing T): cube c's row i
  holds its slots i, T/g + i, ..., (g-1) T/g + i side by side, lane group j slot j T/g + i.
  A TPU pads an array's last dim to 128 lanes in HBM; with g = 128 / gcd(F, 128) the rows
  fill them, and a kernel rebuilds the cube's [T, F] tile by stacking the g lane groups'
  [T/g, F] slices (`pallas_kernels.pack3d_attention.mosaic`). g = 1: the slots as they are."""
  b, rows, f = x.shape
  x = x.reshape(b, rows // t, groups, t // groups, f)
  return jnp.swapaxes(x, 2, 3).reshape(b, rows // groups, groups * f)


def ungroup_rows(x, t: int, groups: int):
  """Inverse of `group_rows`: [B, C * T / g, g * F] -> [B, C * T, F]."""
  b, rows, f = x.shape[0], x.shape[1] * groups, x.shape[2] // groups
  x = x.reshape(b, rows // t, t // groups, groups, f)
  return jnp.swapaxes(x, 2, 3).reshape(b, rows, f)


def _gather_rows(x, index):
  """Rows index [B, R] of x [B, M, ...] (an index >= M gives a zero row) -> [B, R, ...]."""
  m = x.shape[1]
  rows = jax.vmap(lambda f, i: f[i])(x, jnp.minimum(index, m - 1))
  keep = (index < m).reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.where(keep, rows, jnp.zeros((), x.dtype))


@jax.custom_vjp
def permute_rows(x, index, inverse):
  """Rows index [B, R] of x [B, M, ...] (>= M: zero rows) -> [B, R, ...], where inverse [B, M]
  names the output row that holds each row of x (each appears once). The gradient is the
  gather by `inverse`: both directions are gathers, never a scatter (which a TPU runs in
  32 bits over a zero-filled copy of the whole output)."""
  del inverse
  return _gather_rows(x, index)


def _permute_rows_fwd(x, index, inverse):
  return _gather_rows(x, index), (index, inverse)


def _permute_rows_bwd(residuals, g):
  index, inverse = residuals
  return _gather_rows(g, inverse), None, None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _to_groups(x, index, groups: int):
  """x [B, N, F] -> grouped rows [B, C*T/g, g*F]: row p of the [B, C*T, F] view is x's row
  index[b, p] (N: an empty slot, zero). The zeros are selected after the regrouping, in the
  copy that regroups (on TPU a select beside the gather is one more buffer padded to 128
  lanes)."""
  b, n, f = x.shape
  rows = jax.vmap(lambda xb, i: xb[i])(x, jnp.minimum(index, n - 1))
  keep = jnp.repeat((index < n).reshape(b, -1, groups), f, axis=2)
  return jnp.where(keep, rows.reshape(b, -1, groups * f), jnp.zeros((), x.dtype))


def _from_groups(x, position, groups: int):
  """Grouped rows x [B, C*T/g, g*F] -> [B, N, F]: token n from row position[b, n] of the
  [B, C*T, F] view."""
  rows = x.reshape(x.shape[0], -1, x.shape[2] // groups)
  return jax.vmap(lambda xb, p: xb[p])(rows, position)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _regroup(x, index, position, groups: int, to_groups: bool):
  """`_to_groups(x, index)` (to_groups) or `_from_groups(x, position)`, each the other's
  gradient (both gathers, never a scatter: `permute_rows`)."""
  return _to_groups(x, index, groups) if to_groups else _from_groups(x, position, groups)


def _regroup_fwd(x, index, position, groups, to_groups):
  return _regroup(x, index, position, groups, to_groups), (index, position)


def _regroup_bwd(groups, to_groups, residuals, g):
  index, position = residuals
  return _regroup(g, index, position, groups, not to_groups), None, None


_regroup.defvjp(_regroup_fwd, _regroup_bwd)


def cube_distance(a, b):
  """Chebyshev distance max_axis |a - b| of broadcastable [..., 3] cube indices, one axis at a
  time, so nothing [..., 3]-shaped is built (a TPU would pad that 3 to 128 lanes)."""
  distance = jnp.abs(a[..., 0] - b[..., 0])
  for axis in (1, 2):
    distance = jnp.maximum(distance, jnp.abs(a[..., axis] - b[..., axis]))
  return distance


def is_far(query_keys, keys, used, radius: int):
  """Far test on broadcastable [..., 4] cube keys (field, cz, cy, cx): same field, cube
  distance > radius (`cube_distance`), and `used`."""
  distance = cube_distance(keys[..., 1:], query_keys[..., 1:])
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
