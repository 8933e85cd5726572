"""Procedural cell volumes: labels, determinism, packed and padded views of the same fields."""

import numpy as np
import pytest

from neurips26_jax.train.data import volumes

SHAPES = [(8, 8, 8), (8, 12, 16)]


def test_cells_have_all_classes_and_image_tracks_labels():
  fields = volumes.sample_fields(seed=0, stream=0, index=0, count=4, shapes=[(16, 16, 16)])
  for image, labels in fields:
    assert image.dtype == np.float32 and labels.shape == image.shape
    assert set(np.unique(labels)) == {0, 1, 2, 3}
    assert image[labels == 2].mean() > image[labels == 1].mean() > image[labels == 0].mean()


def test_fields_are_a_pure_function_of_seed_stream_index():
  a = volumes.sample_fields(seed=1, stream=0, index=5, count=3, shapes=SHAPES)
  b = volumes.sample_fields(seed=1, stream=0, index=5, count=3, shapes=SHAPES)
  c = volumes.sample_fields(seed=1, stream=1, index=5, count=3, shapes=SHAPES)
  assert all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))
  assert not all(np.array_equal(x[0], y[0]) for x, y in zip(a, c) if x[0].shape == y[0].shape)


def test_packed_and_padded_views_hold_the_same_voxels():
  fields = volumes.sample_fields(seed=0, stream=0, index=0, count=4, shapes=SHAPES)
  packed = volumes.pack(fields, items=2, patch=(4, 4, 4), num_tokens=64)
  dense = volumes.pad(fields, max_shape=(8, 12, 16))
  for b in range(2):
    used = int(packed["mask"][b].sum())
    sizes = [f[0].size // 64 for f in fields[2 * b:2 * b + 2]]
    assert used == sum(sizes)
    rows = np.concatenate([packed["field_ids"][b, :, None], packed["coords"][b]], axis=1)
    assert len(np.unique(rows, axis=0)) == 64                 # unique (field, z, y, x)
    assert packed["labels"][b, :used].sum() == sum(f[1].sum() for f in fields[2 * b:2 * b + 2])
  assert dense["mask"].sum() == sum(f[0].size for f in fields)
  np.testing.assert_array_equal(dense["labels"][1, :8, :12, :16], fields[1][1])


def test_shapes_are_checked():
  with pytest.raises(ValueError, match="multiple of the patch"):
    volumes.check_shapes([(6, 8, 8)], (4, 4, 4), 100, 1)
  with pytest.raises(ValueError, match="num_tokens"):
    volumes.check_shapes([(8, 8, 8)], (4, 4, 4), 15, 2)
