"""The multi-level far field's float64 reference (DESIGN.md section 3.1) against its own math.

`tests/independent_multilevel.py` is checked here without the project's code: levels=1 is the
single-level loop of `tests/independent.py`; the sets Loc, Far_1, ..., Far_L partition each
field for every query; with keys constant on every top-level cube the output is full attention
within the field (the counting argument); and repacking the tokens only permutes the output.
"""

from __future__ import annotations

import functools
import inspect
import math

import numpy as np
import pytest

from tests import independent as ind
from tests import independent_multilevel as iml

BLOCK = (1, 2, 2)  # non-cubic level-1 cubes; level 3 is 4 x 8 x 8
H, D = 2, 12
ROPE = (10000.0, (1.0, 1.0, 1.5))
PAD_FIELD = 9


def _grid(shape):
  return np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"),
                  -1).reshape(-1, 3)


def _padding(n):
  """Padding tokens as the data pipeline lays them out: a field of their own, 4 x 4 slabs."""
  i = np.arange(n)
  return np.stack([i // 16, (i // 4) % 4, i % 4], axis=-1)


def _layout():
  """Two batch entries of 64 tokens, every token order shuffled (fields interleaved).

  Entry 0: field 3 is a (9, 2, 3) grid (partial cubes on x) less 4 random tokens, so some
  interior cubes are partial too; 3 level-3 cubes along z, so with radius 1 every level of
  L = 3 has summaries. Field 7 is (3, 3, 1); then 5 padding tokens.
  Entry 1: field 3 is (1, 11, 4) (partial cubes on y), field 7 is (5, 1, 3); then 5 padding
  tokens.
  """
  rng = np.random.default_rng(11)
  a = _grid((9, 2, 3))
  a = a[np.sort(rng.choice(len(a), len(a) - 4, replace=False))]
  entry0 = (np.concatenate([a, _grid((3, 3, 1)), _padding(5)]),
            np.array([3] * len(a) + [7] * 9 + [PAD_FIELD] * 5))
  entry1 = (np.concatenate([_grid((1, 11, 4)), _grid((5, 1, 3)), _padding(5)]),
            np.array([3] * 44 + [7] * 15 + [PAD_FIELD] * 5))
  coords, fields = [], []
  for c, f in (entry0, entry1):
    assert len(c) == len(f) == 64
    perm = rng.permutation(64)
    coords.append(c[perm])
    fields.append(f[perm])
  return np.stack(coords).astype(np.int32), np.stack(fields).astype(np.int32)


COORDS, FIELDS = _layout()
B, N = FIELDS.shape


def _inputs(seed=0):
  """Un-rotated q, k, v [B, N, H, D] and their rotations by axial RoPE (q, k only)."""
  rng = np.random.default_rng(seed)
  raw = tuple(rng.standard_normal((B, N, H, D)) for _ in range(3))
  rotated = tuple(ind.axial_rope_3d(a, COORDS, theta=ROPE[0], spacing=ROPE[1])
                  for a in raw[:2]) + (raw[2],)
  return raw, rotated


RAW, ROT = _inputs()
BETA = np.array([0.7, -1.3])  # [H]
BETA_LEVELS = np.array([[0.7, -1.3], [-0.4, 1.1], [1.9, 0.2]])  # [L = 3, H]


@functools.lru_cache(maxsize=None)
def multilevel(levels, radius_blocks=1, level_radius=None, beta=None, key="rot"):
  """The reference on the shared inputs; beta: None, "h" ([H]) or "lh" ([L, H])."""
  far_offset = {None: None, "h": BETA, "lh": BETA_LEVELS[:levels]}[beta]
  q, k, v = ROT
  if key == "raw":  # un-rotated inputs, the reference rotates them
    q, k, v = RAW
  return iml.multilevel_attention_reference(
      q, k, v, COORDS, FIELDS, block_shape=BLOCK, radius_blocks=radius_blocks, levels=levels,
      level_radius=level_radius, far_offset=far_offset, rope=ROPE if key == "raw" else None)


def _level_of(coords, i, j, radii, levels):
  """0 if key j is near query i at level 1, else k with j far at level k and near at k+1
  (L if far at every level): the level that must count j, from distances alone."""
  for k in range(1, levels + 1):
    d_k = max(abs(a // (s * 2 ** (k - 1)) - b // (s * 2 ** (k - 1)))
              for a, b, s in zip(coords[j], coords[i], BLOCK, strict=True))
    if d_k <= radii[k - 1]:
      return k - 1
  return levels


RADII_CASES = {  # name: (levels, radius_blocks, level_radius)
    "L1_r1": (1, 1, None),
    "L2_r1": (2, 1, None),
    "L3_r1": (3, 1, None),
    "L3_r0": (3, 0, None),
    "L3_r2_1": (3, 2, 1),
    "L3_r1_2_1": (3, 1, (2, 1)),
    "L4_r0": (4, 0, 0),
}


# ----------------------------------------------------------------------------------------


def test_radius_rule_and_argument_errors():
  assert iml.level_radii(1, 3) == [1, 1, 1]
  assert iml.level_radii(2, 3, 1) == [2, 1, 1]
  assert iml.level_radii(3, 3, (2, 1)) == [3, 2, 1]
  assert iml.level_radii(0, 2, 5) == [0, 5]
  for bad in [dict(radius_blocks=3, levels=2, level_radius=1),  # 1 < ceil(3 / 2)
              dict(radius_blocks=1, levels=3, level_radius=(2, 0)),  # 0 < ceil(2 / 2)
              dict(radius_blocks=-1, levels=1),
              dict(radius_blocks=1, levels=0),
              dict(radius_blocks=1, levels=3, level_radius=(1,))]:
    with pytest.raises(ValueError):
      iml.level_radii(**bad)
  with pytest.raises(ValueError, match="far_offset"):
    iml.multilevel_attention_reference(*ROT, COORDS, FIELDS, block_shape=BLOCK, levels=2,
                                       far_offset=np.zeros((3, H)))


SINGLE_CASES = {  # name: keyword arguments of both references
    "default": {},
    "radius0": {"radius_blocks": 0},
    "radius2": {"radius_blocks": 2},
    "no_bias": {"block_bias": False},
}
if "far_offset" in inspect.signature(ind.pack3d_attention).parameters:
  SINGLE_CASES["far_offset"] = {"far_offset": BETA}


@pytest.mark.parametrize("case", list(SINGLE_CASES))
def test_one_level_is_the_single_level(case):
  """levels=1 is the single-level loop of tests/independent.py (relative rotations on raw q, k
  there, rotated inputs here), whatever level_radius says."""
  kwargs = SINGLE_CASES[case]
  single = ind.pack3d_attention(*RAW, COORDS, FIELDS, block_shape=BLOCK, rope=ROPE, **kwargs)
  ours = iml.multilevel_attention_reference(*ROT, COORDS, FIELDS, block_shape=BLOCK, levels=1,
                                            level_radius=7, **kwargs)
  np.testing.assert_allclose(ours, single, atol=1e-12)
  if "far_offset" in kwargs:  # [1, H] is the same offset as [H]
    rows = iml.multilevel_attention_reference(*ROT, COORDS, FIELDS, block_shape=BLOCK,
                                              levels=1, far_offset=BETA[None])
    np.testing.assert_allclose(rows, single, atol=1e-12)


@pytest.mark.parametrize("case", list(RADII_CASES))
def test_sets_partition_every_field(case):
  """For every query: Loc and the tokens of the Far_k cubes cover its field once; each token
  sits at the level its distances give; cubes are whole; the sets depend on c_1(i) alone."""
  levels, r1, lr = RADII_CASES[case]
  radii = iml.level_radii(r1, levels, lr)
  used = np.zeros(levels + 1, bool)  # which levels some query uses (the test is not vacuous)
  for bi in range(B):
    coords = [tuple(int(x) for x in p) for p in COORDS[bi]]
    by_cube = {}
    for i in range(N):
      local, far = iml.multilevel_sets(COORDS[bi], FIELDS[bi], i, block_shape=BLOCK,
                                       radius_blocks=r1, levels=levels, level_radius=lr)
      field = [j for j in range(N) if FIELDS[bi, j] == FIELDS[bi, i]]
      counted = list(local) + [j for cubes in far for members in cubes.values()
                               for j in members]
      assert sorted(counted) == field, (bi, i)  # exactly once each, nothing from elsewhere
      level = {j: 0 for j in local}
      for k, cubes in enumerate(far, 1):
        for b, members in cubes.items():
          whole = [j for j in field if iml.cube_of(coords[j], BLOCK, k) == b]
          assert sorted(members) == whole, (bi, i, k, b)
          level.update({j: k for j in members})
      for j in field:
        assert level[j] == _level_of(coords, i, j, radii, levels), (bi, i, j)
        used[level[j]] = True
      key = (int(FIELDS[bi, i]), iml.cube_of(coords[i], BLOCK, 1))
      sets = (tuple(local), tuple(tuple(sorted(c)) for c in far))
      assert by_cube.setdefault(key, sets) == sets, (bi, i)
  assert used.all(), used


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_one_hot_values_count_every_token_once(levels):
  """Counting variant: every key the same, values one-hot token ids. The output is each token's
  weight: 1 / |field| under full attention, and so here; with per-level offsets beta_k the
  weight of a token counted at level k is e^{beta_k} / sum over the field (beta_0 = 0)."""
  rng = np.random.default_rng(5)
  q = rng.standard_normal((B, N, H, D))
  k = np.broadcast_to(rng.standard_normal((1, 1, H, D)), (B, N, H, D))
  v = np.broadcast_to(np.eye(N)[None, :, None, :], (B, N, H, N))
  radii = iml.level_radii(1, levels)
  weights = iml.multilevel_attention_reference(q, k, v, COORDS, FIELDS, block_shape=BLOCK,
                                               levels=levels)
  offsets = iml.multilevel_attention_reference(q, k, v, COORDS, FIELDS, block_shape=BLOCK,
                                               levels=levels,
                                               far_offset=BETA_LEVELS[:levels])
  beta = np.concatenate([np.zeros((1, H)), BETA_LEVELS[:levels]])  # row 0: near tokens
  for bi in range(B):
    coords = [tuple(int(x) for x in p) for p in COORDS[bi]]
    for i in range(N):
      field = FIELDS[bi] == FIELDS[bi, i]
      expected = np.where(field, 1.0 / field.sum(), 0.0)
      np.testing.assert_allclose(weights[bi, i], np.broadcast_to(expected, (H, N)),
                                 atol=1e-13)
      e = np.zeros((H, N))
      for j in np.flatnonzero(field):
        e[:, j] = np.exp(beta[_level_of(coords, i, j, radii, levels)])
      np.testing.assert_allclose(offsets[bi, i], e / e.sum(axis=1, keepdims=True), atol=1e-13)


def _constant_per_cube(level, rng):
  """Keys equal within each (field, level-`level` cube), random across cubes: [B, N, H, D]."""
  k = np.zeros((B, N, H, D))
  for bi in range(B):
    table = {}
    for j in range(N):
      key = (int(FIELDS[bi, j]), iml.cube_of(COORDS[bi, j], BLOCK, level))
      k[bi, j] = table.setdefault(key, 2.0 * rng.standard_normal((H, D)))
  return k


@pytest.mark.parametrize("levels,radius_blocks", [(2, 1), (3, 1), (3, 0), (4, 0)])
def test_counting_argument_gives_full_attention(levels, radius_blocks):
  """Keys all identical, and keys constant on every top-level cube: the output is dense
  attention within each field, for every query (beta = 0, log(n_b) on)."""
  rng = np.random.default_rng(levels + 10 * radius_blocks)
  q, v = rng.standard_normal((B, N, H, D)), rng.standard_normal((B, N, H, D))
  same = np.broadcast_to(rng.standard_normal((1, 1, H, D)), (B, N, H, D))
  per_cube = _constant_per_cube(levels, rng)
  for k in (same, per_cube):
    out = iml.multilevel_attention_reference(q, k, v, COORDS, FIELDS, block_shape=BLOCK,
                                             radius_blocks=radius_blocks, levels=levels)
    full = iml.field_attention_rotated(q, k, v, FIELDS)
    np.testing.assert_allclose(out, full, atol=1e-12)
  # The per-cube keys make attention far from uniform (the check is not just a mean of v);
  # and without log(n_b) the summaries are undercounted.
  uniform = iml.field_attention_rotated(q, same, v, FIELDS)
  assert np.max(np.abs(full - uniform)) > 0.1
  no_bias = iml.multilevel_attention_reference(q, same, v, COORDS, FIELDS, block_shape=BLOCK,
                                               radius_blocks=radius_blocks, levels=levels,
                                               block_bias=False)
  assert np.max(np.abs(no_bias - uniform)) > 1e-2


def test_levels_matter_and_limits():
  """On random keys the levels give different outputs; a level-2 radius covering every cube
  is the single level; a level-1 radius covering every cube is full attention."""
  one, two, three = multilevel(1), multilevel(2), multilevel(3)
  for a, b in ((one, two), (two, three), (one, three)):
    assert np.max(np.abs(a - b)) > 1e-2
  np.testing.assert_allclose(multilevel(3, level_radius=(20, 20)), one, atol=1e-12)
  full = ind.field_attention(*RAW, COORDS, FIELDS, rope=ROPE)
  np.testing.assert_allclose(multilevel(3, radius_blocks=20), full, atol=1e-12)
  assert np.max(np.abs(three - full)) > 1e-2


def test_per_level_offsets():
  """beta [H] is the same row at every level; a row of beta [L, H] moves only its level."""
  np.testing.assert_allclose(
      multilevel(3, beta="h"),
      iml.multilevel_attention_reference(*ROT, COORDS, FIELDS, block_shape=BLOCK, levels=3,
                                         far_offset=np.stack([BETA] * 3)), atol=1e-12)
  assert np.max(np.abs(multilevel(3, beta="lh") - multilevel(3, beta="h"))) > 1e-2
  # -inf-like offset on one level == that level's summaries dropped from the softmax.
  far = np.array([[0.0] * H, [-1e4] * H, [0.0] * H])
  dropped = iml.multilevel_attention_reference(*ROT, COORDS, FIELDS, block_shape=BLOCK,
                                               levels=3, far_offset=far)
  q, k, v = ROT
  for bi, i in [(0, 0), (0, 37), (1, 5), (1, 60)]:
    local, cubes = iml.multilevel_sets(COORDS[bi], FIELDS[bi], i, block_shape=BLOCK,
                                       radius_blocks=1, levels=3)
    logits = list(np.einsum("hd,jhd->jh", q[bi, i], k[bi, local]) / math.sqrt(D))
    values = list(v[bi, local])
    for level in (1, 3):
      for members in cubes[level - 1].values():
        logits.append(np.einsum("hd,hd->h", q[bi, i], k[bi, members].mean(0)) / math.sqrt(D)
                      + math.log(len(members)))
        values.append(v[bi, members].mean(0))
    w = np.exp(np.stack(logits) - np.max(logits, axis=0))
    w /= w.sum(axis=0)
    np.testing.assert_allclose(dropped[bi, i], np.einsum("jh,jhd->hd", w, np.stack(values)),
                               atol=1e-12)


def test_packing_order_is_irrelevant():
  """Permuting the tokens (fields, padding and all) permutes the output and nothing else."""
  rng = np.random.default_rng(9)
  perm = np.stack([rng.permutation(N) for _ in range(B)])
  take = lambda a: np.stack([a[bi, perm[bi]] for bi in range(B)])
  out = iml.multilevel_attention_reference(
      *(take(a) for a in RAW), take(COORDS), take(FIELDS), block_shape=BLOCK, levels=3,
      far_offset=BETA_LEVELS, rope=ROPE)
  np.testing.assert_allclose(out, take(multilevel(3, beta="lh", key="raw")), atol=1e-12)
  # The rotation inside the reference is the one the rotated inputs had.
  np.testing.assert_allclose(multilevel(3, beta="lh", key="raw"), multilevel(3, beta="lh"),
                             atol=1e-12)
