"""3D volumes to token grids, many grids to one packed sequence, and packing layouts.

A volume [*batch, Z, Y, X, C] is cut into patches (pz, py, px) and becomes a token grid
[*batch, nz, ny, nx, pz*py*px*C] (`patchify`; `unpatchify` is its inverse). Grids of
different shapes ("fields") are packed into one sequence [*batch, N, d] with, per
token, its (z, y, x) coordinate relative to its field's origin and its field id
(`pack_fields`; `unpack_fields` is its inverse). The attention math only ever sees
(coords, field_ids), never the packed index.

Layouts of the repacking benchmark (`LAYOUTS`): orders of the same tokens, each a
permutation `perm` with its inverse (`layout_permutation`), tokens_new = tokens[..., perm, :]:

  raster_zyx       fields in id order, each in z-major raster order (z slowest)
  raster_xyz       fields in id order, each in x-major raster order (x slowest)
  morton           fields in id order, each along the Z-order curve (bit interleave of z, y, x)
  hilbert          fields in id order, each along the 3D Hilbert curve
  cube_major       fields in id order, each cube of `block_shape` contiguous (cubes and the
                   tokens inside a cube in raster zyx order)
  shuffled_fields  fields in a random order (`seed`), each in raster zyx order

Everything here runs on concrete (numpy) index arrays: it is data preparation.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from neurips26_jax.jaxops import checks

LAYOUTS = ("raster_zyx", "raster_xyz", "morton", "hilbert", "cube_major", "shuffled_fields")

# A volume, grid or token array: numpy in, numpy out; a jax.Array in, a jax.Array out.
Grid = TypeVar("Grid", np.ndarray, jax.Array)


def grid_coords(shape: Sequence[int]) -> np.ndarray:
  """(z, y, x) of every cell of a grid of `shape`, raster zyx order: int32 [prod(shape), 3]."""
  return np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"),
                  axis=-1).reshape(-1, 3).astype(np.int32)


def patchify(volume: Grid, patch: Sequence[int]) -> Grid:
  """[*batch, Z, Y, X, C] -> token grid [*batch, Z/pz, Y/py, X/px, pz*py*px*C].

  Each token holds its patch flattened in (pz, py, px, C) order. Z, Y, X must be
  multiples of the patch size (pad the volume first otherwise).
  """
  checks.zyx("patchify", "patch", patch)
  if volume.ndim < 4:
    raise ValueError(f"patchify: `volume` must be [*batch, Z, Y, X, C], got shape {volume.shape}")
  *batch, z, y, x, c = volume.shape
  if z % patch[0] or y % patch[1] or x % patch[2]:
    raise ValueError(f"patchify: `volume` spatial shape {(z, y, x)} is not a multiple of"
                     f" the patch {tuple(patch)}")
  pz, py, px = patch
  nb = len(batch)
  v = volume.reshape(*batch, z // pz, pz, y // py, py, x // px, px, c)
  v = v.transpose(*range(nb), nb, nb + 2, nb + 4, nb + 1, nb + 3, nb + 5, nb + 6)
  return v.reshape(*batch, z // pz, y // py, x // px, pz * py * px * c)


def unpatchify(grid: Grid, patch: Sequence[int]) -> Grid:
  """Inverse of `patchify`: [*batch, nz, ny, nx, pz*py*px*C] -> [*batch, Z, Y, X, C]."""
  checks.zyx("unpatchify", "patch", patch)
  if grid.ndim < 4:
    raise ValueError(f"unpatchify: `grid` must be [*batch, nz, ny, nx, d], got shape {grid.shape}")
  pz, py, px = patch
  *batch, nz, ny, nx, width = grid.shape
  if width % (pz * py * px):
    raise ValueError(f"unpatchify: `grid` token width {width} is not a multiple of the"
                     f" patch volume {pz * py * px}")
  c = width // (pz * py * px)
  nb = len(batch)
  v = grid.reshape(*batch, nz, ny, nx, pz, py, px, c)
  v = v.transpose(*range(nb), nb, nb + 3, nb + 1, nb + 4, nb + 2, nb + 5, nb + 6)
  return v.reshape(*batch, nz * pz, ny * py, nx * px, c)


def pack_fields(grids: Sequence[Grid], *,
                width: int | None = None) -> tuple[Grid, np.ndarray, np.ndarray]:
  """Packs token grids [*batch, Z_i, Y_i, X_i, d] (same batch and d) into one sequence.

  width: the d the grids must have (a model's d_model), if given; a raw volume [Z, Y, X, C]
    that was not patchified and embedded then fails here instead of making Z Y X tokens of C.

  Returns:
    tokens: [*batch, N, d], N = sum_i Z_i Y_i X_i, fields one after another, each in
      raster zyx order (reorder with `layout_permutation`);
    coords: int32 [N, 3], each token's (z, y, x) in its own field;
    field_ids: int32 [N], the index i of each token's field.
  """
  if hasattr(grids, "shape"):
    raise TypeError(f"pack_fields: `grids` must be a list of grids, got one array of shape "
                    f"{tuple(grids.shape)}: pass [grid] for a single field")
  if not grids:
    raise ValueError("pack_fields: `grids` is empty")
  lead = grids[0].shape[:-4] + grids[0].shape[-1:]
  for i, g in enumerate(grids):
    if g.ndim < 4 or g.shape[:-4] + g.shape[-1:] != lead:
      raise ValueError(f"pack_fields: grid {i} has shape {g.shape}; expected [*batch, Z, Y, X, d]"
                       f" with batch and d {lead} like grid 0")
  if width is not None and lead[-1] != width:
    raise ValueError(f"pack_fields: grid 0 has shape {tuple(grids[0].shape)}, d = {lead[-1]} "
                     f"features per token, but `width` is {width}: a raw volume [Z, Y, X, C] is "
                     "patchified (packing.patchify) and embedded to the model width first")
  xp = np if all(isinstance(g, np.ndarray) for g in grids) else jnp
  tokens = xp.concatenate([g.reshape(*g.shape[:-4], -1, g.shape[-1]) for g in grids], axis=-2)
  coords = np.concatenate([grid_coords(g.shape[-4:-1]) for g in grids])
  field_ids = np.concatenate([np.full(int(np.prod(g.shape[-4:-1])), i, np.int32)
                              for i, g in enumerate(grids)])
  return tokens, coords, field_ids


def unpack_fields(tokens: Grid, shapes: Sequence[Sequence[int]]) -> list[Grid]:
  """Inverse of `pack_fields`: [*batch, N, d] -> list of [*batch, Z_i, Y_i, X_i, d]."""
  sizes = [int(np.prod(s)) for s in shapes]
  if sum(sizes) != tokens.shape[-2]:
    raise ValueError(f"unpack_fields: `tokens` has {tokens.shape[-2]} tokens (shape"
                     f" {tokens.shape}); the field `shapes` {list(shapes)} hold {sum(sizes)}")
  starts = np.cumsum([0] + sizes)
  return [tokens[..., a:b, :].reshape(*tokens.shape[:-2], *s, tokens.shape[-1])
          for a, b, s in zip(starts[:-1], starts[1:], shapes)]


# ----------------------------------------------------------------------------- curves

def _bits(coords) -> int:
  return max(1, int(coords.max()).bit_length())


def _interleave(axes, bits: int) -> np.ndarray:
  """Bit interleave of the arrays `axes` (first axis most significant within each triple)."""
  key = np.zeros(axes[0].shape, np.int64)
  for bit in range(bits - 1, -1, -1):
    for a in axes:
      key = (key << 1) | ((a >> bit) & 1)
  return key


def morton_key(coords: ArrayLike) -> np.ndarray:
  """Z-order index of (z, y, x) coords [n, 3] (non-negative ints): int64 [n]."""
  c = np.asarray(coords, np.int64)
  return _interleave([c[:, 0], c[:, 1], c[:, 2]], _bits(c))


def hilbert_key(coords: ArrayLike) -> np.ndarray:
  """3D Hilbert index of (z, y, x) coords [n, 3] (non-negative ints): int64 [n].

  Skilling's transform ("Programming the Hilbert curve", AIP Conf. Proc. 707, 2004): undo
  the excess work of the axes, Gray-encode, then interleave the bits. Consecutive
  indices on a 2^b cube are face neighbours.
  """
  c = np.asarray(coords, np.int64)
  bits = _bits(c)
  x = [c[:, 0].copy(), c[:, 1].copy(), c[:, 2].copy()]
  q = 1 << (bits - 1)
  while q > 1:
    p = q - 1
    for i in range(3):
      high = (x[i] & q) != 0
      t = np.where(high, 0, (x[0] ^ x[i]) & p)
      x[0] = np.where(high, x[0] ^ p, x[0] ^ t)
      if i:
        x[i] = x[i] ^ t
    q >>= 1
  for i in (1, 2):
    x[i] = x[i] ^ x[i - 1]
  t = np.zeros_like(x[0])
  q = 1 << (bits - 1)
  while q > 1:
    t = np.where((x[2] & q) != 0, t ^ (q - 1), t)
    q >>= 1
  return _interleave([a ^ t for a in x], bits)


def _within_field_keys(coords, layout: str, block_shape) -> list:
  """Sort keys inside a field, most significant first."""
  z, y, x = coords[:, 0], coords[:, 1], coords[:, 2]
  if layout in ("raster_zyx", "shuffled_fields"):
    return [z, y, x]
  if layout == "raster_xyz":
    return [x, y, z]
  if layout == "morton":
    return [morton_key(coords)]
  if layout == "hilbert":
    return [hilbert_key(coords)]
  cube, local = coords // np.asarray(block_shape), coords % np.asarray(block_shape)
  return [cube[:, 0], cube[:, 1], cube[:, 2], local[:, 0], local[:, 1], local[:, 2]]


def layout_permutation(coords: ArrayLike, field_ids: ArrayLike, layout: str, *,
                       block_shape: Sequence[int] = (4, 4, 4),
                       seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """The order of `layout` (see module docstring) as (perm, inverse), both int32 [N].

  Args:
    coords: int [N, 3] non-negative (z, y, x) per token; field_ids: int [N].
  Returns:
    perm with tokens_new = tokens[perm] in the layout's order, and inverse with
    tokens = tokens_new[inverse].
  """
  coords, field_ids = np.asarray(coords), np.asarray(field_ids)
  if coords.ndim != 2 or coords.shape[1] != 3 or field_ids.shape != coords.shape[:1]:
    raise ValueError(f"layout_permutation: `coords` must be [N, 3] and `field_ids` [N]; got"
                     f" {coords.shape} and {field_ids.shape}")
  checks.one_of("layout_permutation", "layout", layout, LAYOUTS)
  checks.zyx("layout_permutation", "block_shape", block_shape)
  if coords.size and coords.min() < 0:
    raise ValueError("layout_permutation: `coords` must be non-negative")
  field_rank = field_ids
  if layout == "shuffled_fields":
    ids = np.unique(field_ids)
    shuffled = np.random.default_rng(seed).permutation(len(ids))
    field_rank = shuffled[np.searchsorted(ids, field_ids)]
  keys = [field_rank] + _within_field_keys(coords, layout, block_shape)
  perm = np.lexsort(keys[::-1]).astype(np.int32)
  inverse = np.empty_like(perm)
  inverse[perm] = np.arange(len(perm), dtype=np.int32)
  return perm, inverse
