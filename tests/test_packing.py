"""Patchify, field packing and the repacking layouts (each a permutation with its inverse)."""

from __future__ import annotations

import numpy as np
import pytest

from neurips26_jax.jaxops import packing

SHAPES = [(3, 5, 2), (4, 4, 4), (1, 3, 7)]


def _packed():
  grids = [np.random.default_rng(i).normal(size=(2, *s, 4)) for i, s in enumerate(SHAPES)]
  return grids, *packing.pack_fields(grids)


def test_patchify_roundtrip_and_patch_contents():
  vol = np.random.default_rng(0).normal(size=(2, 4, 6, 3, 5))
  grid = packing.patchify(vol, (2, 3, 1))
  assert grid.shape == (2, 2, 2, 3, 2 * 3 * 1 * 5)
  np.testing.assert_array_equal(grid[1, 1, 0, 2], vol[1, 2:4, 0:3, 2:3].reshape(-1))
  np.testing.assert_array_equal(packing.unpatchify(grid, (2, 3, 1)), vol)


def test_pack_unpack_roundtrip():
  grids, tokens, coords, field_ids = _packed()
  assert tokens.shape == (2, sum(np.prod(s) for s in SHAPES), 4)
  for i, (g, s) in enumerate(zip(packing.unpack_fields(tokens, SHAPES), SHAPES)):
    np.testing.assert_array_equal(g, grids[i])
    z, y, x = coords[field_ids == i].T
    np.testing.assert_array_equal(tokens[:, field_ids == i], grids[i][:, z, y, x])
    assert coords[field_ids == i].max(0).tolist() == [n - 1 for n in s]


@pytest.mark.parametrize("layout", packing.LAYOUTS)
def test_layouts_are_permutations_keeping_fields_contiguous(layout):
  _, _, coords, field_ids = _packed()
  perm, inverse = packing.layout_permutation(coords, field_ids, layout, block_shape=(2, 2, 2))
  np.testing.assert_array_equal(np.sort(perm), np.arange(len(perm)))
  np.testing.assert_array_equal(perm[inverse], np.arange(len(perm)))
  f = field_ids[perm]
  assert np.count_nonzero(np.diff(f)) == len(SHAPES) - 1  # every field in one run


def test_layout_orders():
  coords = packing.grid_coords((4, 4, 4))
  fields = np.zeros(64, np.int32)
  order = lambda name: coords[packing.layout_permutation(coords, fields, name,
                                                         block_shape=(2, 2, 2))[0]]
  np.testing.assert_array_equal(order("raster_zyx"), coords)
  assert order("raster_xyz")[:4, 2].tolist() == [0, 0, 0, 0]  # x slowest
  assert order("raster_xyz")[:4, 0].tolist() == [0, 1, 2, 3]  # z fastest
  np.testing.assert_array_equal(order("morton")[:8], packing.grid_coords((2, 2, 2)))
  cube = order("cube_major") // 2
  assert len(np.unique(cube[:8], axis=0)) == 1 and len(np.unique(cube[8:16], axis=0)) == 1
  steps = np.abs(np.diff(order("hilbert"), axis=0)).sum(axis=1)
  assert steps.max() == 1  # consecutive Hilbert cells are face neighbours


def test_shuffled_fields_changes_field_order_only():
  _, _, coords, field_ids = _packed()
  runs = set()
  for seed in range(6):
    perm, _ = packing.layout_permutation(coords, field_ids, "shuffled_fields", seed=seed)
    f = field_ids[perm]
    runs.add(tuple(f[np.r_[0, np.flatnonzero(np.diff(f)) + 1]]))
    for i in range(len(SHAPES)):  # raster zyx inside each field
      np.testing.assert_array_equal(coords[perm][f == i], coords[field_ids == i])
  assert len(runs) > 1


def test_bad_inputs_name_the_argument():
  with pytest.raises(ValueError, match="`volume` spatial shape"):
    packing.patchify(np.zeros((1, 5, 4, 4, 1)), (2, 2, 2))
  with pytest.raises(ValueError, match="`layout` must be one of"):
    packing.layout_permutation(np.zeros((3, 3), int), np.zeros(3, int), "spiral")
  with pytest.raises(ValueError, match="`coords` must be non-negative"):
    packing.layout_permutation(-np.ones((3, 3), int), np.zeros(3, int), "morton")
  with pytest.raises(ValueError, match="grid 1 has shape"):
    packing.pack_fields([np.zeros((2, 2, 2, 3)), np.zeros((2, 2, 2, 4))])
  with pytest.raises(ValueError, match="`tokens` has 8 tokens"):
    packing.unpack_fields(np.zeros((8, 3)), [(2, 2, 3)])
