"""Procedural cell-like 3D volumes with label volumes, packed or padded for segmentation.

One field = one volume of shape (Z, Y, X) drawn from `shapes` (multiples of the patch):
  labels  0 background, 1 cytoplasm (an irregular ellipsoid cell), 2 nucleus (an ellipsoid
          inside it), 3 an internal structure (a few small blobs in the cytoplasm)
  image   class intensities with texture, Gaussian blur (the microscope's point-spread
          function), then Poisson-like shot noise and Gaussian read noise, normalized.
A batch holds `batch * fields_per_item` fields, a pure function of (seed, stream, index), in
two views of the same fields:
  packed (Pack3D): per item, the fields' patch tokens one after another, padded to `num_tokens`
    tokens [B, N, p^3], labels [B, N, p^3], coords [B, N, 3], field_ids [B, N], mask [B, N]
    (padding tokens form one extra field laid out as 4x4 slabs, mask 0)
  dense (U-Net): every field zero-padded to `max_shape`
    image [B * F, Z, Y, X, 1], labels [B * F, Z, Y, X], mask [B * F, Z, Y, X]
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from neurips26_jax.jaxops import packing

NUM_CLASSES = 4
_INTENSITY = np.array([0.05, 0.35, 0.7, 1.0], np.float32)


def _ellipsoid(grid, center, radii, rotation, scale=1.0):
  """Boolean mask of a rotated ellipsoid scaled by `scale` (a number or a [Z, Y, X] field);
  grid [3, Z, Y, X] voxel centres."""
  d = np.tensordot(rotation.T, grid - center[:, None, None, None], axes=1)
  return np.sum((d / radii[:, None, None, None]) ** 2, axis=0) <= np.square(scale)


def _rotation(rng) -> np.ndarray:
  q, r = np.linalg.qr(rng.normal(size=(3, 3)))
  return q * np.sign(np.diag(r))


def _blur(x, sigma: float):
  """Separable Gaussian blur along the three axes (reflect padding)."""
  radius = max(1, int(math.ceil(3 * sigma)))
  t = np.arange(-radius, radius + 1)
  kernel = np.exp(-0.5 * (t / sigma) ** 2)
  kernel /= kernel.sum()
  for axis in range(3):
    pad = [(0, 0)] * 3
    pad[axis] = (radius, radius)
    xp = np.pad(x, pad, mode="reflect")
    x = sum(w * np.take(xp, np.arange(i, i + x.shape[axis]), axis=axis)
            for i, w in enumerate(kernel))
  return x


def cell_volume(rng: np.random.Generator, shape: Sequence[int]):
  """(image float32 [Z, Y, X] ~ zero mean unit variance, labels int32 [Z, Y, X])."""
  shape = np.asarray(shape)
  grid = np.stack(np.meshgrid(*(np.arange(n) + 0.5 for n in shape), indexing="ij"))
  center = shape / 2 + rng.uniform(-0.1, 0.1, 3) * shape
  radii = rng.uniform(0.3, 0.45, 3) * shape
  rot = _rotation(rng)
  bumpy = _blur(rng.normal(size=tuple(shape)), 2.0)          # irregular membrane
  cell = _ellipsoid(grid, center, radii, rot, 1 + 0.8 * bumpy) | _ellipsoid(
      grid, center, radii * 0.7, rot)
  nucleus = _ellipsoid(grid, center + rng.uniform(-0.15, 0.15, 3) * radii,
                       radii * rng.uniform(0.35, 0.5, 3), _rotation(rng)) & cell
  labels = np.where(nucleus, 2, np.where(cell, 1, 0)).astype(np.int32)
  cyto = np.argwhere(labels == 1)
  for idx in rng.choice(len(cyto), size=min(len(cyto), rng.integers(3, 7)), replace=False):
    blob = _ellipsoid(grid, cyto[idx] + 0.5, rng.uniform(0.8, 2.0, 3), _rotation(rng))
    labels[blob & (labels == 1)] = 3
  texture = 1 + 0.3 * _blur(rng.normal(size=tuple(shape)), 1.0)
  signal = _blur(_INTENSITY[labels] * texture, rng.uniform(0.7, 1.2))
  photons = rng.poisson(np.clip(signal, 0, None) * 50) / 50.0
  image = photons + rng.normal(0, 0.03, photons.shape)
  image = (image - image.mean()) / (image.std() + 1e-6)
  return image.astype(np.float32), labels


def sample_fields(*, seed: int, stream: int, index: int, count: int,
                  shapes: Sequence[Sequence[int]]):
  """count (image, labels) volumes with shapes drawn from `shapes`; pure in (seed, stream, index)."""
  rng = np.random.default_rng([seed, stream, index])
  return [cell_volume(rng, shapes[rng.integers(len(shapes))]) for _ in range(count)]


def check_shapes(shapes, patch, num_tokens, fields_per_item) -> None:
  """ValueError unless every shape is a multiple of the patch and an item fits num_tokens."""
  for s in shapes:
    if len(s) != 3 or any(n % p for n, p in zip(s, patch)):
      raise ValueError(f"volumes: field shape {tuple(s)} is not a multiple of the patch "
                       f"{tuple(patch)}")
  worst = fields_per_item * max(math.prod(s) // math.prod(patch) for s in shapes)
  if worst > num_tokens:
    raise ValueError(f"volumes: {fields_per_item} fields may need {worst} tokens, more than "
                     f"num_tokens={num_tokens}")


def _padding_coords(n: int) -> np.ndarray:
  i = np.arange(n)
  return np.stack([i // 16, (i // 4) % 4, i % 4], axis=-1).astype(np.int32)


def pack(fields, *, items: int, patch: Sequence[int], num_tokens: int) -> dict:
  """Packed view: `items` sequences of len(fields) / items fields each (see module doc)."""
  per = len(fields) // items
  p3 = math.prod(patch)
  out = {"tokens": np.zeros((items, num_tokens, p3), np.float32),
         "labels": np.zeros((items, num_tokens, p3), np.int32),
         "coords": np.zeros((items, num_tokens, 3), np.int32),
         "field_ids": np.zeros((items, num_tokens), np.int32),
         "mask": np.zeros((items, num_tokens), np.float32)}
  for b in range(items):
    group = fields[b * per:(b + 1) * per]
    grids = [packing.patchify(img[..., None], patch) for img, _ in group]
    label_grids = [packing.patchify(lab[..., None], patch) for _, lab in group]
    tokens, coords, ids = packing.pack_fields(grids)
    labels, _, _ = packing.pack_fields(label_grids)
    n = len(tokens)
    out["tokens"][b, :n], out["labels"][b, :n] = tokens, labels
    out["coords"][b, :n], out["field_ids"][b, :n], out["mask"][b, :n] = coords, ids, 1.0
    out["coords"][b, n:], out["field_ids"][b, n:] = _padding_coords(num_tokens - n), per
  return out


def pad(fields, *, max_shape: Sequence[int]) -> dict:
  """Dense view: every field zero-padded to max_shape (see module doc)."""
  out = {"image": np.zeros((len(fields), *max_shape, 1), np.float32),
         "labels": np.zeros((len(fields), *max_shape), np.int32),
         "mask": np.zeros((len(fields), *max_shape), np.float32)}
  for i, (img, lab) in enumerate(fields):
    z, y, x = img.shape
    out["image"][i, :z, :y, :x, 0], out["labels"][i, :z, :y, :x] = img, lab
    out["mask"][i, :z, :y, :x] = 1.0
  return out
