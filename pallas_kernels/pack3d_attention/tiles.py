"""Pack3D attention tile math and tile plan, shared by the Mosaic and Triton kernels.

Per query cube (a tile of T slots) one online softmax over two key streams (MASK = -1e30,
a finite -inf): the <= (2r+1)^3 neighbour cubes (exact tokens, empty slots masked), then
blocks of S cube summaries (with levels >= 2 those of every level) whose bias is computed
here from the cubes' keys::

  s = q K^T / sqrt(D) + bias          bias: key slot mask, or log n_b (+ beta_h) on far
                                      cubes / MASK
  m' = max(m, rowmax s) ; l = e^{m-m'} l + rowsum e^{s-m'} ; acc = e^{m-m'} acc + e^{s-m'} V
  o = acc / l ;  lse = m + log l

Backward (FlashAttention-2 style, p = e^{s - lse}, delta = rowsum(do * o)):
  dq = sum (p (do V^T - delta)) K / sqrt(D) ;  dK = (p (do V^T - delta))^T q / sqrt(D) ;
  dV = p^T do ;  d beta_h = sum of ds = p (do V^T - delta) over the far summaries.

Far cubes are never stored as a C x C table (C^2 floats: 256 MiB at 262k tokens): each
program derives its row of far biases from the query cube's key (field, cz, cy, cx) and
the summary block's keys and counts (`far_bias`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops.pack3d import MASK
from neurips26_jax.jaxops.tiling import dot, dot_nt, dot_tn, next_pow2, round_up
from neurips26_jax.pallas_kernels.dispatch import Backend
from neurips26_jax.pallas_kernels.pack3d_attention.blocks import BlockSizes

_F32 = jnp.float32


# ----------------------------------------------------------------------------
# Tile math. q, do [T, D]; k, v [Tk, D]; bias [1, Tk]; lse, delta [T, 1].
# ----------------------------------------------------------------------------

def scores(q, k, bias, scale):
  return dot_nt(q, k) * scale + bias


def init_state(t, d):
  return (jnp.full((t, 1), MASK, _F32), jnp.zeros((t, 1), _F32), jnp.zeros((t, d), _F32))


def softmax_step(carry, q, k, v, bias, scale):
  """One key tile of the online softmax: carry (m, l, acc) -> updated carry."""
  m, l, acc = carry
  s = scores(q, k, bias, scale)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
  return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
          alpha * acc + dot(p.astype(v.dtype), v))


def finish(m, l, acc):
  return acc / l, m + jnp.log(l)


def _probs_and_dscores(q, k, v, bias, do, lse, delta, scale):
  """p = e^{s - lse} and ds = p (do v^T - delta), both [T, Tk] float32."""
  p = jnp.exp(scores(q, k, bias, scale) - lse)
  return p, p * (dot_nt(do, v) - delta)


def dq_step(q, k, v, bias, do, lse, delta, scale):
  _, ds = _probs_and_dscores(q, k, v, bias, do, lse, delta, scale)
  return dot(ds.astype(k.dtype), k) * scale


def dkv_step(q, k, v, bias, do, lse, delta, scale):
  p, ds = _probs_and_dscores(q, k, v, bias, do, lse, delta, scale)
  return dot_tn(ds.astype(q.dtype), q) * scale, dot_tn(p.astype(do.dtype), do)


def dsummary_step(q, k, v, bias, do, lse, delta, scale):
  """`dkv_step` for a block of summaries, and the column sums of ds [1, Tk] (float32): each
  summary's share of d beta_h."""
  p, ds = _probs_and_dscores(q, k, v, bias, do, lse, delta, scale)
  return (dot_tn(ds.astype(q.dtype), q) * scale, dot_tn(p.astype(do.dtype), do),
          jnp.sum(ds, axis=0, keepdims=True))


# ----------------------------------------------------------------------------
# Far biases from cube keys. cube_rows [8, S]: rows field, cz, cy, cx, count and (with
# levels >= 2) the summary's level k, float32; cz, cy, cx are level-k cube indices. A query
# cube's key (its level-1 (field, cz, cy, cx)) comes from an [R, 8] block of cube_cols.
# ----------------------------------------------------------------------------

def block_row(rows, i):
  """Row i of a small float32 block as [1, S] (a masked sum: no value slicing)."""
  ids = jax.lax.broadcasted_iota(jnp.int32, rows.shape, 0)
  return jnp.sum(jnp.where(ids == i, rows, 0.0), axis=0, keepdims=True)


def entry(row, j):
  """row[0, j] as [1, 1]."""
  ids = jax.lax.broadcasted_iota(jnp.int32, row.shape, 1)
  return jnp.sum(jnp.where(ids == j, row, 0.0), axis=1, keepdims=True)


def query_key(cols, r):
  """(field, cz, cy, cx) of the cube in row r of a [R, 8] block of cube_cols, each [1, 1]."""
  row = block_row(cols, r)
  return tuple(entry(row, j) for j in range(4))


def far_bias(key, rows, radii, block_bias: bool, offset=None):
  """[1, S] float32: log n_b (or 0), plus the head's far offset [1, 1] if given, for the far
  summaries of the query cube `key`; MASK else. radii: (r_1, ..., r_L) (see `far_bias_of`)."""
  used = 5 if len(radii) == 1 else 6   # the level row only with levels
  return far_bias_of(key, [block_row(rows, i) for i in range(used)], radii, block_bias, offset)


def far_bias_of(key, rows, radii, block_bias: bool, offset=None):
  """`far_bias` from the summaries' (field, cz, cy, cx, count[, level]) as arrays of one shape
  (the Mosaic GPU kernels load them as vectors in a WGMMA layout); key entries and offset
  broadcast against them. offset: the head's beta (every level's), or with levels >= 2 a
  tuple (beta_1, ..., beta_L) of per-level offsets (`head_offsets`), beta_k on level k.

  One level (radii = (r,)): cube b is far iff same field, n_b > 0 and d(a, b) > r. Levels
  (DESIGN.md section 3.1): a level-k summary b is far iff same field, n_b > 0 and
  b in Far_k(a) (`_in_far_level`)."""
  field, z, y, x, count = rows[:5]
  if len(radii) == 1:
    gap = lambda a, b: jnp.maximum(a - b, b - a)  # |a - b| (Mosaic lowers abs through sign,
    distance = jnp.maximum(jnp.maximum(gap(z, key[1]), gap(y, key[2])), gap(x, key[3]))  # which
    # asks the TPU generation and so fails a lowering from CPU)
    far = (field == key[0]) & (distance > radii[0]) & (count > 0.0)
  else:
    far = (field == key[0]) & (count > 0.0) & _in_far_level(key[1:], (z, y, x), rows[5], radii)
  bias = jnp.log(jnp.maximum(count, 1.0)) if block_bias else jnp.zeros_like(count)
  if isinstance(offset, tuple):  # the summary's level picks its beta_k
    offset = sum(jnp.where(rows[5] == k, beta, 0.0) for k, beta in enumerate(offset, 1))
  if offset is not None:
    bias = bias + offset
  return jnp.where(far, bias, MASK)


def head_offsets(row, levels: int):
  """One head's far offsets from a [1, Lo] row of them: Lo = 1 (one beta for every level) its
  [1, 1] value, else the tuple of Lo per-level values [1, 1] that `far_bias_of` reads."""
  if levels == 1:
    return row
  return tuple(entry(row, k) for k in range(levels))


def _ancestor(c, up: int):
  """The level-(1 + up) index floor(c / 2^up) of a level-1 cube index c >= 0 (float32,
  exact below 2^24): an integer shift (neither floor nor floor division lowers everywhere:
  Mosaic GPU has no floor, and jnp's // lowers through sign)."""
  if up == 0:
    return c
  return jax.lax.shift_right_arithmetic(c.astype(jnp.int32), up).astype(_F32)


def _in_far_level(own, cube, level, radii):
  """Whether summary b (level-k index `cube` = (z, y, x), its level k in `level`) is in
  Far_k(a) for the query cube with level-1 index `own`, L = len(radii):

    d_k(a_k, b) > r_k  and  (k = L or d_{k+1}(a_{k+1}, parent(b)) <= r_{k+1}),
    a_k = a >> (k - 1),  parent(b) = b >> 1.

  The parent test reads only the query's side: |a_{k+1} - floor(b / 2)| <= r per axis iff
  2 (a_{k+1} - r) <= b <= 2 (a_{k+1} + r) + 1, so nothing is divided per summary."""
  levels, hits = len(radii), None
  for k, radius in enumerate(radii, 1):
    mine = [_ancestor(c, k - 1) for c in own]
    gaps = [jnp.maximum(b - a, a - b) for a, b in zip(mine, cube)]
    far = jnp.maximum(jnp.maximum(gaps[0], gaps[1]), gaps[2]) > radius
    if k < levels:
      up = radii[k]
      for a, b in zip(own, cube):
        parent = _ancestor(a, k)
        far = far & (b >= 2.0 * (parent - up)) & (b <= 2.0 * (parent + up) + 1.0)
    hit = (level == k) & far
    hits = hit if hits is None else hits | hit
  return hits


def absent_refs(kernel, positions):
  """kernel(*refs) called with None at `positions` (ascending, in its full argument list):
  for calls that leave out optional operands (the far offset and its gradient)."""
  if not positions:
    return kernel

  def run(*refs):
    refs = list(refs)
    for i in positions:
      refs.insert(i, None)
    return kernel(*refs)
  return run


# ----------------------------------------------------------------------------
# The tile plan and the operands. Per batch entry b, tokens cube-major, heads on the lanes
# (an [.., H*D] row is dense on TPU lanes, where [.., H, D] pads D to 128 in HBM), g slots
# of H*D side by side per row (`lane_groups`; `jaxops.pack3d_layout.group_rows` says which):
#   q, k, v, o, do [B, C*T/g, g*H*D]; lse, delta [B, C, H, T] float32 (one row of T per head)
#   kbar, vbar [B, Cs, H*D] (Cs: the summaries, C per level-1 cube and with levels >= 2
#   those of levels 2..L after them, padded to a multiple of S)
#   key_bias [B, C, 1, T] float32 (0 for a token, MASK for an empty slot)
#   cube_rows [B, 8, Cs] (one column per summary), cube_cols [B, C, 8] (one row per
#   level-1 query cube) float32 (see `far_bias`)
#   neighbours [B, C, K] int32, num_neighbours [B, C] int32 (see jaxops.pack3d_layout.CubeLayout)
#   offset [H, 1, Lo] float32 (beta_h, Lo = 1, or per level beta_{k,h}, Lo = L; only with a
#   far offset), its gradient's per-summary parts d_offset [B, H, Cs] float32 (summed
#   outside, per level with Lo = L)
# The Mosaic kernels read these as they are (g = `lane_groups`); the GPU kernels get g = 1
# (their HBM is not tiled) and the Triton ones move the heads first (and pad D to a power of
# two) on the way in, and back on the way out.
# ----------------------------------------------------------------------------

def lane_groups(t: int, width: int, dtype, compiled: bool = True) -> int:
  """g, the slots side by side in one row of the Mosaic kernels' token operands: 128 /
  gcd(H*D, 128), the fewest whose g * H*D fills whole 128-lane tiles (a TPU pads the last dim
  of an HBM array to them: H*D = 96 alone takes 128 lanes); 1 where H*D does already or
  where a cube's T / g rows would not fill a sublane tile (8 rows of 32 bits, 16 of 16).
  compiled=False (interpret mode) lifts the sublane minimum, so small tests group too."""
  groups = 128 // math.gcd(width, 128)
  rows = 32 // jnp.dtype(dtype).itemsize if compiled else 1
  return groups if t % (groups * rows) == 0 else 1


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key_bias", "cube_rows", "cube_cols", "neighbours",
                                "num_neighbours"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Tables:
  """The cube structure as the kernels read it (shapes above)."""

  key_bias: jax.Array
  cube_rows: jax.Array
  cube_cols: jax.Array
  neighbours: jax.Array
  num_neighbours: jax.Array


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Static sizes of one call: B, H, C cubes, T slots per cube, D (the head width) and d
  (its tile width: D, or D padded to a power of two for Triton, to a multiple of 16 for
  Mosaic GPU), K neighbours per cube, the number of summaries (C with one level, every
  level's summaries with several), S summaries per step, Cs = the summaries padded to S, the
  softmax scale, the far test's radii (r_1, ..., r_L; `far_bias`) and bias, (Mosaic) query
  cubes per call, (Triton) query rows per dK/dV step, and whether the far logits carry a
  per-head offset (an operand, and a gradient output) and Lo, its values per head: 1 (every
  level's) or L (per level), and g, the slots per token-operand row (`lane_groups`; Mosaic
  only, 1 for the GPU kernels)."""

  batch: int
  heads: int
  cubes: int
  t: int
  head_dim: int
  d: int
  k_max: int
  summaries: int
  s_block: int
  c_s: int
  scale: float
  radii: tuple[int, ...]
  block_bias: bool
  cubes_per_call: int
  dkv_rows: int
  far_offset: bool = False
  offset_levels: int = 1
  groups: int = 1

  @classmethod
  def make(cls, backend: Backend, blocks: BlockSizes, q, tables: Tables, *, heads: int,
           radii: tuple[int, ...], block_bias: bool, compiled: bool,
           far_offset: bool = False, offset_levels: int = 1, groups: int = 1) -> "TilePlan":
    """q [B, C*T/g, g*H*D] (g = groups); the summaries are cube_rows' columns.
    compiled=False (interpret mode) lifts the compilers' minimum block_summaries (Mosaic: 128
    lanes; Triton: 16 for tl.dot), so small tests can walk several summary blocks."""
    batch, d = q.shape[0], q.shape[2] // (heads * groups)
    cubes, _, t = tables.key_bias.shape[1:]
    summaries = tables.cube_rows.shape[2]
    s = blocks.block_summaries
    if backend == "triton":  # power-of-two tiles, >= 16 for tl.dot
      if s & (s - 1) or s < (16 if compiled else 1):
        raise ValueError(f"pack3d_attention: Triton block size `block_summaries` must be a "
                         f"power of two >= 16, got {s}")
      rows = min(blocks.block_q_dkv, t)
      if rows & (rows - 1) or rows < (16 if compiled else 1):
        raise ValueError(f"pack3d_attention: Triton block size `block_q_dkv` must be a power "
                         f"of two >= 16, got {blocks.block_q_dkv}")
      s, d_pad, per_call = min(s, next_pow2(summaries)), next_pow2(d), cubes
    elif backend == "mosaic_gpu":  # summaries are WGMMA's M rows in the summary kernel
      if s % 64:
        raise ValueError(f"pack3d_attention: Mosaic GPU block size `block_summaries` must be "
                         f"a multiple of 64, got {s}")
      # D on WGMMA's contraction axis: whole 16-element steps (zero columns change nothing)
      s, d_pad, per_call, rows = min(s, round_up(summaries, 64)), round_up(d, 16), cubes, t
    else:  # Mosaic: summaries are the lane axis of cube_rows' blocks
      if round_up(summaries, 8) <= s:
        s = round_up(summaries, 8)
      elif s % (128 if compiled else 8):
        raise ValueError(f"pack3d_attention: Mosaic block size `block_summaries` must be a "
                         f"multiple of 128 (or hold every cube), got {s}")
      d_pad, per_call, rows = d, min(blocks.cubes_per_call, cubes), t
    return cls(batch, heads, cubes, t, d, d_pad, tables.neighbours.shape[2], summaries, s,
               round_up(summaries, s), 1.0 / math.sqrt(d), tuple(radii), block_bias, per_call,
               rows, far_offset, offset_levels, groups)

  @property
  def summary_blocks(self) -> int:
    return self.c_s // self.s_block

  def pad_summaries(self, kbar, vbar, tables: Tables):
    """Summaries [B, summaries, H*D] padded to Cs rows, cube_rows to Cs columns (count 0:
    not far)."""
    extra = self.c_s - self.summaries
    pad_rows = lambda x: jnp.pad(x, ((0, 0), (0, extra), (0, 0)))
    rows = jnp.pad(tables.cube_rows, ((0, 0), (0, 0), (0, extra)))
    return pad_rows(kbar), pad_rows(vbar), dataclasses.replace(tables, cube_rows=rows)
