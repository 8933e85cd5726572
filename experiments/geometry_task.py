"""A synthetic 3D token task whose labels need geometry near (local shape) and far (a marker).

One field is a token grid of shape (Z, Y, X) with C = 4 input channels per token:
  0 object   1 inside one of 2-3 axis-aligned boxes (sides 2-4 tokens, a gap of at least
             one token between boxes)
  1, 2       marker one-hot: a single token (marker="token") or every token of its cube
             (marker="cube"), in a corner cube of the field, whose class m in {0, 1} is
             the class of every object in the field
  3          Gaussian noise (a distractor)
Labels (5 classes): 0 background (and the marker token), and for object tokens
  1 + 2 m + s,   s = 1 if the token is on its box's surface (a 6-neighbour is outside the box)
So a token's label needs its local geometry (which of its neighbours are object: exact
relative positions) and something far away (the marker: every object token is at least
two cubes, Chebyshev, from the marker's cube, i.e. outside the local branch's radius-1
neighbourhood of `block_shape` cubes; only the far branch's cube summaries reach it). A
single-token marker is 1/|cube| of its cube's mean-pooled summary; marker="cube" makes the
summary carry it whole, which is what makes the far part learnable in a CPU budget.

A batch packs `fields_per_item` fields per item, padded to `num_tokens` like
`train.data.volumes.pack` (padding: one extra field, mask 0). Items are in raster zyx
order (`jaxops.packing.pack_fields`); `relayout` reorders a batch into any of
`jaxops.packing.LAYOUTS`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from neurips26_jax.jaxops import packing

NUM_CLASSES = 5
CHANNELS = 4


def _corner_cubes(cubes):
  return [(z, y, x) for z in (0, cubes[0] - 1) for y in (0, cubes[1] - 1)
          for x in (0, cubes[2] - 1)]


MARKERS = ("token", "cube")


def field(rng: np.random.Generator, shape: Sequence[int], block_shape: Sequence[int],
          max_tries: int = 200, marker_kind: str = "token"):
  """(features float32 [Z, Y, X, C], labels int32 [Z, Y, X]) of one field (module doc)."""
  if marker_kind not in MARKERS:
    raise ValueError(f"geometry field: `marker` must be one of {MARKERS}, got {marker_kind!r}")
  shape, block = np.asarray(shape), np.asarray(block_shape)
  cubes = -(-shape // block)
  if np.any(cubes < 3):
    raise ValueError(f"geometry field: shape {tuple(shape)} needs at least 3 cubes of "
                     f"{tuple(block)} per axis (a marker two cubes away from the objects)")
  corners = _corner_cubes(cubes)
  marker_cube = np.asarray(corners[rng.integers(len(corners))])
  lo = marker_cube * block
  hi = np.minimum(lo + block, shape)
  marker = np.asarray([rng.integers(a, b) for a, b in zip(lo, hi)])
  m = int(rng.integers(2))
  grid = np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), axis=-1)
  cube_of = grid // block
  allowed = np.max(np.abs(cube_of - marker_cube), axis=-1) >= 2      # far from the marker
  occupied = np.zeros(tuple(shape), bool)                          # boxes grown by 1
  labels = np.zeros(tuple(shape), np.int32)
  obj = np.zeros(tuple(shape), np.float32)
  boxes = int(rng.integers(2, 4))
  placed = 0
  for _ in range(max_tries):
    if placed == boxes:
      break
    size = rng.integers(2, 5, 3)
    if np.any(size > shape):
      continue
    start = np.asarray([rng.integers(0, n - s + 1) for n, s in zip(shape, size)])
    sl = tuple(slice(a, a + s) for a, s in zip(start, size))
    grown = tuple(slice(max(a - 1, 0), a + s + 1) for a, s in zip(start, size))
    if not allowed[sl].all() or occupied[sl].any():
      continue
    occupied[grown] = True
    obj[sl] = 1.0
    local = grid[sl] - start
    surface = np.any((local == 0) | (local == size - 1), axis=-1)
    labels[sl] = 1 + 2 * m + surface.astype(np.int32)
    placed += 1
  features = np.zeros((*shape, CHANNELS), np.float32)
  features[..., 0] = obj
  if marker_kind == "cube":
    features[tuple(slice(a, b) for a, b in zip(lo, hi)) + (1 + m,)] = 1.0
  else:
    features[tuple(marker) + (1 + m,)] = 1.0
  features[..., 3] = rng.normal(0.0, 0.5, tuple(shape))
  return features, labels


def batch(*, seed: int, stream: int, index: int, items: int, fields_per_item: int,
          shapes: Sequence[Sequence[int]], block_shape: Sequence[int], num_tokens: int,
          marker: str = "token") -> dict:
  """Packed batch (raster zyx): tokens [B, N, C], labels [B, N], coords [B, N, 3],
  field_ids [B, N], mask [B, N]; fields' shapes drawn from `shapes`; pure in
  (seed, stream, index)."""
  rng = np.random.default_rng([seed, stream, index])
  out = {"tokens": np.zeros((items, num_tokens, CHANNELS), np.float32),
         "labels": np.zeros((items, num_tokens), np.int32),
         "coords": np.zeros((items, num_tokens, 3), np.int32),
         "field_ids": np.zeros((items, num_tokens), np.int32),
         "mask": np.zeros((items, num_tokens), np.float32)}
  for b in range(items):
    group = [field(rng, shapes[rng.integers(len(shapes))], block_shape, marker_kind=marker)
             for _ in range(fields_per_item)]
    tokens, coords, ids = packing.pack_fields([f for f, _ in group])
    labels = np.concatenate([lab.reshape(-1) for _, lab in group])
    n = len(tokens)
    if n > num_tokens:
      raise ValueError(f"geometry batch: {n} tokens exceed num_tokens={num_tokens}")
    out["tokens"][b, :n], out["labels"][b, :n] = tokens, labels
    out["coords"][b, :n], out["field_ids"][b, :n], out["mask"][b, :n] = coords, ids, 1.0
    pad = np.arange(num_tokens - n)
    out["coords"][b, n:] = np.stack([pad // 16, (pad // 4) % 4, pad % 4], -1)
    out["field_ids"][b, n:] = fields_per_item
  return out


def relayout(batch: dict, layout: str, *, block_shape, seed: int = 0) -> tuple[dict, list]:
  """The batch with every item's tokens reordered into `layout`; and the per-item
  permutations (new = old[perm])."""
  perms = [packing.layout_permutation(batch["coords"][b], batch["field_ids"][b], layout,
                                      block_shape=block_shape, seed=seed + b)[0]
           for b in range(len(batch["coords"]))]
  return {k: np.stack([v[b][p] for b, p in enumerate(perms)]) for k, v in batch.items()}, perms


def marker_class_right(pred: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """bool: the prediction is an object label with the marker class m of `labels` (object
  labels 1 + 2 m + s): the far part of a token's label."""
  return (pred > 0) & ((pred - 1) // 2 == (labels - 1) // 2)


def token_metrics(pred: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> dict:
  """Accuracy on real tokens, on object tokens (exact label), and on object tokens split
  into the far part (marker class m right) and the near part (surface flag s right)."""
  real = mask > 0
  objects = real & (labels > 0)
  pred_obj = pred[objects]
  lab_obj = labels[objects]
  is_obj = pred_obj > 0
  m_ok = marker_class_right(pred_obj, lab_obj)
  s_ok = is_obj & ((pred_obj - 1) % 2 == (lab_obj - 1) % 2)
  return {"acc_tokens": float((pred[real] == labels[real]).mean()),
          "acc_objects": float((pred_obj == lab_obj).mean()),
          "acc_far_marker": float(m_ok.mean()), "acc_near_surface": float(s_ok.mean()),
          "object_tokens": int(objects.sum())}
