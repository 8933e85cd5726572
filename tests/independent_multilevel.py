"""Independent float64 reference for Pack3D's multi-level far field (DESIGN.md section 3.1).

Written from DESIGN.md alone: nothing here imports `jaxops`, `pallas_kernels` or `models`, or
was written from their code. The only import from the project is `tests.independent`'s axial
RoPE, itself numpy-only and written from DESIGN.md. For each query token the sets Loc(i) and
Far_1(i), ..., Far_L(i) are built literally from their definitions (cubes of every level
enumerated, their two distance conditions tested), then one softmax runs over near tokens and
summaries, a plain loop over queries. Sizes in the tests are tiny; readability comes first.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from tests.independent import axial_rope_3d, softmax_mix


def level_radii(radius_blocks: int, levels: int, level_radius=None) -> list[int]:
  """[r_1, ..., r_L]: r_1 = radius_blocks; r_k (k >= 2) from level_radius (int, L-1 ints, or
  None = radius_blocks at every level). Raises ValueError unless r_k >= 0 and
  r_{k+1} >= ceil(r_k / 2)."""
  if int(levels) != levels or levels < 1:
    raise ValueError(f"levels must be an int >= 1; got {levels!r}")
  if level_radius is None:
    rest = [radius_blocks] * (levels - 1)
  elif isinstance(level_radius, Sequence):
    rest = list(level_radius)
    if len(rest) != levels - 1:
      raise ValueError(f"level_radius needs levels - 1 = {levels - 1} entries; got {rest}")
  else:
    rest = [level_radius] * (levels - 1)
  radii = [int(r) for r in [radius_blocks, *rest]]
  for k, r in enumerate(radii, 1):
    if r < 0:
      raise ValueError(f"the level-{k} radius must be >= 0; got {r}")
    if k < levels and radii[k] < math.ceil(r / 2):
      raise ValueError(f"the level-{k + 1} radius {radii[k]} is below ceil(r_{k} / 2) ="
                       f" {math.ceil(r / 2)}: keys would be counted twice or missed")
  return radii


def cube_of(position, block_shape, level: int) -> tuple:
  """c_k(j) = floor(p_j / (block_shape 2^(k-1))) per axis; positions are non-negative."""
  return _cube_of(tuple(int(p) for p in position), tuple(int(s) for s in block_shape),
                  int(level))


@functools.lru_cache(maxsize=1 << 16)
def _cube_of(position: tuple, block_shape: tuple, level: int) -> tuple:
  return tuple(p // (s * 2 ** (level - 1)) for p, s in zip(position, block_shape, strict=True))


def parent(cube) -> tuple:
  """parent(b) = floor(b / 2): the level-(k+1) cube holding the level-k cube b."""
  return tuple(int(x) // 2 for x in cube)


def distance(a, b) -> int:
  """Chebyshev distance between two cube indices of the same level."""
  return max(abs(int(x) - int(y)) for x, y in zip(a, b, strict=True))


def multilevel_sets(coords, field_ids, i: int, *, block_shape, radius_blocks: int, levels: int,
                    level_radius=None):
  """Loc(i) and Far_1(i), ..., Far_L(i) for query token i of ONE batch entry.

  coords int [N, 3], field_ids int [N]. Returns (local, far): local is the sorted list of the
  token indices in Loc(i); far[k-1] is a dict {level-k cube index: [its tokens]} for the cubes
  of Far_k(i). Every set is restricted to i's field.
  """
  coords = [tuple(int(x) for x in p) for p in np.asarray(coords)]
  field_ids = [int(f) for f in np.asarray(field_ids)]
  block_shape = tuple(int(s) for s in block_shape)
  radii = level_radii(radius_blocks, levels, level_radius)
  field = [j for j in range(len(field_ids)) if field_ids[j] == field_ids[i]]
  local = [j for j in field
           if distance(_cube_of(coords[j], block_shape, 1),
                       _cube_of(coords[i], block_shape, 1)) <= radii[0]]
  far = []
  for k in range(1, levels + 1):
    cubes: dict[tuple, list[int]] = {}  # the non-empty level-k cubes of i's field
    for j in field:
      cubes.setdefault(_cube_of(coords[j], block_shape, k), []).append(j)
    mine = _cube_of(coords[i], block_shape, k)
    chosen = {}
    for b, members in cubes.items():
      if distance(b, mine) <= radii[k - 1]:  # inside the level-k neighbourhood
        continue
      if k < levels and distance(parent(b), _cube_of(coords[i], block_shape, k + 1)) > radii[k]:
        continue  # outside the level-(k+1) neighbourhood: a coarser level covers it
      chosen[b] = members
    far.append(chosen)
  return local, far


def _far_offset_rows(far_offset, levels: int, heads: int):
  """beta as [L, H] float64: None -> zeros, [H] -> the same row at every level."""
  if far_offset is None:
    return np.zeros((levels, heads))
  beta = np.asarray(far_offset, np.float64)
  if beta.shape == (heads,):
    return np.broadcast_to(beta, (levels, heads))
  if beta.shape == (levels, heads):
    return beta
  raise ValueError(f"far_offset must be [H] = [{heads}] or [L, H] = [{levels}, {heads}];"
                   f" got {beta.shape}")


def multilevel_attention_reference(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4),
                                   radius_blocks=1, levels=1, level_radius=None,
                                   far_offset=None, block_bias=True, rope=None,
                                   level_key_gain=1.0):
  """Multi-level Pack3D attention (DESIGN.md section 3.1), one query token at a time, float64.

  q, k [B, N, H, D]; v [B, N, H, Dv] (Dv = D for the ops; any width here); coords int
  [B, N, 3]; field_ids int [B, N]. rope=None: q, k are already rotated (the ops' contract);
  rope=(theta, spacing): they are not, and are rotated per token by axial RoPE first (so the
  summaries average rotated keys). far_offset: beta, [H] or [L, H] (None: 0).
  level_key_gain: g, the factor g^(k-1) on a level-k summary's key; 1 here (the counting-
  exact field these tests check), where the ops' default is 8: pass it explicitly.
  Returns o [B, N, H, Dv].

    s_ij = q_i . k_j / sqrt(D)                                       j in Loc(i)
    s_ib = g^(k-1) q_i . kbar_b / sqrt(D) + log(n_b) + beta_{k,h}    b in Far_k(i), k = 1..L
    o_i  = softmax over all of them of [v_j ; vbar_b]
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  coords = np.asarray(coords).astype(np.int64)
  field_ids = np.asarray(field_ids)
  if rope is not None:
    theta, spacing = rope
    q = axial_rope_3d(q, coords, theta=theta, spacing=spacing)
    k = axial_rope_3d(k, coords, theta=theta, spacing=spacing)
  batch, n, heads, d = q.shape
  beta = _far_offset_rows(far_offset, levels, heads)
  out = np.zeros(v.shape)
  for bi in range(batch):
    for i in range(n):
      local, far = multilevel_sets(coords[bi], field_ids[bi], i, block_shape=block_shape,
                                   radius_blocks=radius_blocks, levels=levels,
                                   level_radius=level_radius)
      logits = list(np.einsum("hd,jhd->jh", q[bi, i], k[bi, local]) / math.sqrt(d))
      values = list(v[bi, local])
      for level, cubes in enumerate(far, 1):
        for members in cubes.values():
          n_b = len(members)
          kbar = k[bi, members].mean(axis=0)  # [H, D]
          vbar = v[bi, members].mean(axis=0)
          gain = level_key_gain ** (level - 1)
          logit = gain * np.einsum("hd,hd->h", q[bi, i], kbar) / math.sqrt(d)
          if block_bias:
            logit = logit + math.log(n_b)
          logits.append(logit + beta[level - 1])
          values.append(vbar)
      out[bi, i] = softmax_mix(logits, values)
  return out


def field_attention_rotated(q, k, v, field_ids):
  """Dense softmax attention within each field on already rotated q, k (float64)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  field_ids = np.asarray(field_ids)
  batch, n, _, d = q.shape
  out = np.zeros(v.shape)
  for bi in range(batch):
    for i in range(n):
      js = [j for j in range(n) if field_ids[bi, j] == field_ids[bi, i]]
      logits = np.einsum("hd,jhd->jh", q[bi, i], k[bi, js]) / math.sqrt(d)
      weights = np.exp(logits - logits.max(axis=0))
      weights /= weights.sum(axis=0)
      out[bi, i] = np.einsum("jh,jhd->hd", weights, v[bi, js])
  return out
