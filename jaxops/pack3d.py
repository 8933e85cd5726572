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
tokens cube-major (`jaxops.pack3d_layout.cube_layout`), gathers the <= (2r+1)^3 neighbour
cubes of each query cube and attends to them and to all far summaries (cost per query
(2r+1)^3 T + C for T tokens per cube and C cubes), in chunks of query cubes recomputed in
the backward. Both give the same result. The Pallas kernel (`pallas_kernels.pack3d_attention`)
shares the cube layout and `cube_summaries` with the XLA path.

Under `jit`, coords/field_ids may be concrete (exact cube structure at trace time) or
traced (`max_cubes` slots); see `jaxops.pack3d_layout`. Coordinates must be unique within
a field. With traced coords, a batch entry the layout cannot hold (more cubes than slots,
negative coords) cannot raise from a compiled program: its output is NaN (so a training
run stops on it), and `jaxops.pack3d_layout.layout_status` tells the caller which entries
and why.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import pack3d_levels as levels_lib
from neurips26_jax.jaxops.pack3d_layout import CubeLayout, cube_layout, is_far, poison_overflow
from neurips26_jax.jaxops.rope import axial_rope_3d_float

_F32 = jnp.float32
MASK = -1e30  # finite "minus infinity": fully masked rows stay finite (and are discarded)


# ----------------------------------------------------------------------------- checks

def check_pack3d_inputs(q: jax.Array, k: jax.Array, v: jax.Array, coords: ArrayLike,
                        field_ids: ArrayLike, block_shape: Sequence[int], radius_blocks: int,
                        gates: jax.Array | None = None,
                        far_offset: ArrayLike | None = None) -> None:
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


# ----------------------------------------------------------------------------- cube summaries

def cube_summaries(layout: CubeLayout, k_cubes: jax.Array, v_cubes: jax.Array,
                   coords: ArrayLike | None = None,
                   summary_rope: dict[str, Any] | None = None) -> tuple[jax.Array, jax.Array]:
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

def per_token_cube_sum(x: jax.Array, cube_id: jax.Array) -> jax.Array:
  """x [B, N, ...] -> the sum of x over each token's cube, [B, N, ...] float32; cube_id
  [B, N] in [0, N) names each token's cube.

  A segment sum (scatter-add), not a matmul with a [N, N] same-cube matrix: how a GPU's
  GEMM library splits a contraction is its autotuner's choice, one place where the
  reference can differ between chips (it did between CPU and an H200, cause not yet
  found: the repository's benchmarks/README.md, GPU check); an add per token has no such freedom.
  """
  one = lambda x, ids: jax.ops.segment_sum(x.astype(_F32), ids, num_segments=ids.shape[0])[ids]
  return jax.vmap(one)(x, cube_id)


def pack3d_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, coords: ArrayLike,
                               field_ids: ArrayLike, *, block_shape: Sequence[int] = (4, 4, 4),
                               radius_blocks: int = 1, block_bias: bool = True,
                               gates: jax.Array | None = None,
                               summary_rope: dict[str, Any] | None = None,
                               far_offset: ArrayLike | None = None) -> jax.Array:
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
  # each token's cube as the index of the cube's first token: segment ids in [0, N)
  cube_id = jnp.argmax(same_field & (distance == 0), axis=-1)          # [B, N]
  n = per_token_cube_sum(jnp.ones(cube_id.shape, _F32), cube_id)     # n_c(j), [B, N]
  per_token_mean = lambda x: (per_token_cube_sum(x, cube_id)
                              / n.reshape(n.shape + (1,) * (x.ndim - 2)))
  if summary_rope is None:
    kbar = per_token_mean(k32)
  else:
    pos = coords.astype(_F32)
    kbar = per_token_mean(axial_rope_3d_float(k32, -pos, **summary_rope))
    centre = per_token_mean(pos)
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

def _local_scores(q, k_cubes, v_cubes, key_valid, neighbours, num_neighbours):
  """The local part of a chunk of query cubes: scores [c, H, T, K T] against the tokens of
  their neighbour cubes (MASK on empty slots and unused neighbour entries), and those values
  [c, K T, H, D]."""
  c, t, h, d = q.shape
  k_loc = k_cubes[neighbours].reshape(c, -1, h, d)                    # [c, K T, H, D]
  v_loc = v_cubes[neighbours].reshape(c, -1, h, d)
  in_set = jnp.arange(neighbours.shape[1]) < num_neighbours[:, None]  # [c, K]
  valid = (key_valid[neighbours] & in_set[:, :, None]).reshape(c, 1, 1, -1)
  s_loc = jnp.einsum("cqhd,ckhd->chqk", q, k_loc, preferred_element_type=_F32) / math.sqrt(d)
  return jnp.where(valid, s_loc, MASK), v_loc


def _attend_chunk(q, k_cubes, v_cubes, key_valid, kbar, vbar, far_bias, neighbours,
                  num_neighbours, gates, far_offset):
  """Query cubes of one chunk of one batch entry.

  q [c, T, H, D]; k_cubes, v_cubes [C, T, H, D]; key_valid [C, T]; kbar, vbar [C, H, D];
  far_bias [c, C]; neighbours [c, K]; num_neighbours [c]; gates [c, T, H, 2] or None;
  far_offset [H] float32 or None.
  Returns [c, T, H, D] float32.
  """
  s_loc, v_loc = _local_scores(q, k_cubes, v_cubes, key_valid, neighbours, num_neighbours)
  scale = 1.0 / math.sqrt(q.shape[-1])
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


def pack3d_attention(q: jax.Array, k: jax.Array, v: jax.Array, coords: ArrayLike,
                     field_ids: ArrayLike, *, block_shape: Sequence[int] = (4, 4, 4),
                     radius_blocks: int = 1, block_bias: bool = True,
                     gates: jax.Array | None = None, summary_rope: dict[str, Any] | None = None,
                     far_offset: ArrayLike | None = None, max_cubes: int | None = None,
                     chunk: int = 16, levels: int = 1,
                     level_radius: int | Sequence[int] | None = None,
                     max_top_cubes: int | None = None,
                     level_key_gain: float | None = None) -> jax.Array:
  """Fast XLA path of Pack3D attention; same arguments and result as the reference.

  Args (beyond the reference's):
    max_cubes: cube slots for traced coords (see module docstring); ignored otherwise.
    chunk: query cubes per step; each step is `jax.checkpoint`ed, so activation memory
      is O(chunk T (K T + C) H) for K neighbour cubes rather than O(N (K T + C) H).
    levels: far-field levels (DESIGN.md section 3.1, `jaxops.pack3d_levels`); 1 is the
      single level above. With levels >= 2 the far part is level-1 summaries of the cubes in
      a query's level-2 neighbourhood, level-2 summaries beyond it up to the level-3 one, ...,
      and level-L summaries of everything beyond; far_offset may be [H] or [levels, H];
      `gates` and `summary_rope` are single-level options.
    level_radius: the radii r_2..r_L in cubes of their own level (an int, levels - 1 ints,
      or None: radius_blocks); each r_{k+1} >= ceil(r_k / 2).
    max_top_cubes: slots of the top level's cubes with traced coords (concrete ones give the
      exact count). None: max_cubes, which fits any layout but makes every query cube attend
      to max_cubes top-level slots, O(N max_cubes / T) like the single level. The top
      level's box volume (one 64 x 128 x 128 field, 4^3 cubes, levels = 3: 4 x 8 x 8 = 256
      plus a margin for boxes that straddle) makes the far field near-linear; an entry that
      needs more gets NaN outputs, as for max_cubes.
    level_key_gain: g, with levels >= 2: a level-k summary's logit is
      g^(k-1) q . kbar_b / sqrt(D) + log(n_b) + beta. None: 8 (`pack3d_levels.KEY_GAIN`),
      which undoes the 1/8^(k-1) dilution of a feature that fills one level-1 cube; 1 keeps
      the counting argument exact (DESIGN.md 3.1).
  Returns:
    o [B, N, H, D] in q.dtype (matmuls in the input dtype, float32 accumulation).
  """
  radii = levels_lib.level_radii(radius_blocks, levels, level_radius)
  key_gain = levels_lib.check_level_options(levels, max_top_cubes, level_key_gain, gates=gates,
                                            summary_rope=summary_rope)
  if levels > 1:
    beta = levels_lib.offsets_per_level(far_offset, levels, q.shape[2])
    far_offset = None if beta is None else beta[0]     # the [H] form, for the input checks
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

  if levels > 1:
    return _multilevel(q, layout, q_c, k_c, v_c, kbar, vbar, starts, radii, block_bias, beta,
                       max_top_cubes, key_gain)
  count = layout.count
  bias = jnp.where(count > 0, jnp.log(jnp.maximum(count, 1.0)) if block_bias else 0.0, MASK)
  o_c = jax.vmap(one_entry)(q_c, k_c, v_c, layout.key_valid(), kbar, vbar, layout.keys, bias,
                            layout.neighbours, layout.num_neighbours, g_c)
  return poison_overflow(layout, layout.from_cubes(o_c)).astype(q.dtype)


def _multilevel(q, layout, q_c, k_c, v_c, kbar, vbar, starts, radii, block_bias, beta,
                max_top_cubes, key_gain):
  """The XLA path with levels >= 2: the single level's local part, then for each level k < L
  the summaries of Far_k read from the 8 (2 r_{k+1} + 1)^3 children of the query cube's
  level-(k+1) neighbourhood (`pack3d_levels.candidates`), and the top level's summaries of
  every top-level cube beyond r_L; one softmax over all of them."""
  levels, cubes = len(radii), layout.num_cubes
  top = levels_lib.top_slots(layout.keys, layout.count, levels, max_top_cubes)
  log_n = lambda n: jnp.log(jnp.maximum(n, 1.0)) if block_bias else jnp.zeros_like(n)

  def one_entry(q_c, k_c, v_c, key_valid, kbar, vbar, keys, count, neighbours, num_nb):
    per_level = levels_lib.level_structure(keys, count, kbar, vbar, levels, key_gain)
    keys_t, count_t, kbar_t, vbar_t = (x[:top] for x in per_level[-1][:4])

    def step(ids):
      query = keys[ids]
      gathered, biases, offsets = [], [], []
      for k in range(1, levels):
        _, count_k, kbar_k, vbar_k, box = per_level[k - 1]
        slots, far = levels_lib.candidates(query, box, k, radii[k - 1], radii[k])
        far &= count_k[slots] > 0
        gathered.append((kbar_k[slots], vbar_k[slots]))                   # [c, K, H, D]
        biases.append(jnp.where(far, log_n(count_k[slots]), MASK))
        if beta is not None:
          offsets.append(jnp.repeat(beta[k - 1][:, None], slots.shape[1], axis=1))
      near = (jnp.concatenate([g[0] for g in gathered], 1),
              jnp.concatenate([g[1] for g in gathered], 1), jnp.concatenate(biases, 1),
              None if beta is None else jnp.concatenate(offsets, 1))
      far_top = levels_lib.top_mask(query, keys_t, count_t, levels, radii[-1])
      top_part = (kbar_t, vbar_t, jnp.where(far_top, log_n(count_t)[None], MASK),
                  None if beta is None else beta[-1])
      return _attend_levels(q_c[ids], k_c, v_c, key_valid, neighbours[ids], num_nb[ids], near,
                            top_part).astype(q_c.dtype)   # a permutation from here: cast now

    o = jax.lax.map(jax.checkpoint(step), starts)
    return o.reshape(-1, *o.shape[2:])[:cubes]

  o_c = jax.vmap(one_entry)(q_c, k_c, v_c, layout.key_valid(), kbar, vbar, layout.keys,
                            layout.count, layout.neighbours, layout.num_neighbours)
  o = poison_overflow(layout, layout.from_cubes(o_c))
  return levels_lib.poison_top_overflow(o, layout.keys, layout.count, levels, top).astype(q.dtype)


def _attend_levels(q, k_cubes, v_cubes, key_valid, neighbours, num_neighbours, near, top):
  """Query cubes of one chunk with the multi-level far field: the local part as in
  `_attend_chunk`; near = (kbar, vbar [c, K, H, D], bias [c, K], offset [H, K] or None): each
  query cube's own lower-level summaries; top = (kbar, vbar [M, H, D], bias [c, M], offset
  [H] or None): the top level's, shared. Returns [c, T, H, D] float32."""
  s_loc, v_loc = _local_scores(q, k_cubes, v_cubes, key_valid, neighbours, num_neighbours)
  scale = 1.0 / math.sqrt(q.shape[-1])
  q32 = q.astype(_F32)
  kbar_n, vbar_n, bias_n, off_n = near
  s_near = jnp.einsum("cqhd,cbhd->chqb", q32, kbar_n) * scale + bias_n[:, None, None]
  if off_n is not None:
    s_near = s_near + off_n[None, :, None, :]
  kbar_t, vbar_t, bias_t, off_t = top
  s_top = jnp.einsum("cqhd,bhd->chqb", q32, kbar_t) * scale + bias_t[:, None, None]
  if off_t is not None:
    s_top = s_top + off_t[None, :, None, None]
  rows = lambda x: jnp.max(x, axis=-1, keepdims=True)
  m = jnp.maximum(jnp.maximum(rows(s_loc), rows(s_near)), rows(s_top))
  p_loc, p_near, p_top = (jnp.exp(s - m) for s in (s_loc, s_near, s_top))
  total = lambda p: jnp.moveaxis(jnp.sum(p, axis=-1), 1, -1)[..., None]   # [c, T, H, 1]
  o = (jnp.einsum("chqk,ckhd->cqhd", p_loc.astype(v_loc.dtype), v_loc,
                  preferred_element_type=_F32)
       + jnp.einsum("chqb,cbhd->cqhd", p_near, vbar_n) + jnp.einsum("chqb,bhd->cqhd", p_top, vbar_t))
  return o / (total(p_loc) + total(p_near) + total(p_top))
