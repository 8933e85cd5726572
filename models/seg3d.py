"""Pack3DSegmenter: 3D segmentation over packed fields with Pack3D attention blocks.

  tokens [B, N, p^3 C]  (patchified voxels, `jaxops.packing.patchify` + `pack_fields`)
  -> patch embedding (linear) [B, N, d]
  -> depth x Block(Pack3DAttention(., coords, field_ids), FFN)        (models.block)
  -> RMSNorm -> per-token head -> logits [B, N, p^3, K] (float32)
`voxel_logits` turns one item's token logits back into per-field voxel volumes [Z, Y, X, K].
Many volumes of different shapes go in one item: only (coords, field_ids) tell them apart.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from neurips26_jax.jaxops import checks, packing
from neurips26_jax.models.block import FFNS, Block, make_ffn
from neurips26_jax.models.impl import Impl
from neurips26_jax.models.norm import RMSNorm
from neurips26_jax.models.partitioning import param


class Pack3DSegmenter(nnx.Module):
  """Per-voxel class logits for packed 3D fields (see the module docstring).

  tokens [B, N, p^3 C], coords int [B, N, 3], field_ids int [B, N] -> logits [B, N, p^3, K].

  Args:
    patch, in_channels, num_classes: patch (pz, py, px), C and K.
    d_model, depth, num_heads: width, number of blocks, attention heads (d / H % 6 == 0 for
      axial RoPE).
    ffn, ffn_options: as in models.block.make_ffn.
    attention_options: extra Pack3DAttention arguments (block_shape, radius_blocks, position,
      max_cubes, ...).
    impl: "auto", "pallas", "xla" or "reference" for Pack3D attention and FlashFFN (see
      `models.impl`); interpret: passed to their kernels.
    dtype: compute dtype (None: float32); parameters stay float32.
  """

  def __init__(self, *, patch: Sequence[int] = (4, 4, 4), in_channels: int = 1,
               num_classes: int, d_model: int, depth: int, num_heads: int, ffn: str = "swiglu",
               ffn_options: dict | None = None, attention_options: dict | None = None,
               impl: Impl = "auto", interpret: Any = None, dtype: DTypeLike | None = None,
               rngs: nnx.Rngs) -> None:
    # lazy: Pack3D's own module
    from neurips26_jax.models.pack3d import Pack3DAttention  # noqa: PLC0415
    checks.one_of("Pack3DSegmenter", "ffn", ffn, FFNS)
    checks.ints("Pack3DSegmenter", dict(d_model=d_model, depth=depth, num_heads=num_heads,
                                        num_classes=num_classes, in_channels=in_channels))
    checks.zyx("Pack3DSegmenter", "patch", patch)
    self.patch, self.num_classes, self.dtype = tuple(patch), num_classes, dtype
    voxels = math.prod(patch)
    self.embed = param(jax.random.normal(rngs.params(), (voxels * in_channels, d_model))
                       * (voxels * in_channels) ** -0.5, "vocab", "embed")
    self.embed_bias = param(jnp.zeros((d_model,)), "channels")
    self.blocks = nnx.List([
        Block(Pack3DAttention(d_model, num_heads, impl=impl, interpret=interpret, dtype=dtype,
                              rngs=rngs, **(attention_options or {})),
              make_ffn(ffn, d_model, impl=impl, interpret=interpret, dtype=dtype,
                       options=dict(ffn_options or {}), rngs=rngs, owner="Pack3DSegmenter"),
              d_model)
        for _ in range(depth)])
    self.norm = RMSNorm(d_model)
    self.head = param(jax.random.normal(rngs.params(), (d_model, voxels * num_classes))
                      * d_model ** -0.5, "embed", "vocab")

  def __call__(self, tokens: jax.Array, coords: ArrayLike, field_ids: ArrayLike) -> jax.Array:
    """tokens [B, N, p^3 C], coords int [B, N, 3], field_ids int [B, N] -> [B, N, p^3, K]."""
    checks.sequence("Pack3DSegmenter", "tokens", tokens, self.embed.shape[0], "p^3 C")
    dtype = self.dtype or jnp.float32
    x = tokens.astype(dtype) @ self.embed[...].astype(dtype) + self.embed_bias[...].astype(dtype)
    for block in self.blocks:
      x = block(x, coords, field_ids)
    logits = jnp.einsum("bnd,dk->bnk", self.norm(x), self.head[...].astype(dtype),
                        preferred_element_type=jnp.float32)
    return logits.reshape(*logits.shape[:2], math.prod(self.patch), self.num_classes)


def voxel_logits(token_logits: jax.Array, shapes: Sequence[Sequence[int]],
                 patch: Sequence[int]) -> list[jax.Array]:
  """One item's token logits [N, p^3, K] (fields packed in order, as `pack_fields` does, padding
  after) -> a list of voxel logits [Z_i, Y_i, X_i, K] for fields of voxel `shapes`."""
  grids = [tuple(s // p for s, p in zip(shape, patch)) for shape in shapes]
  used = sum(math.prod(g) for g in grids)
  flat = token_logits[:used].reshape(used, -1)
  return [packing.unpatchify(f, patch) for f in packing.unpack_fields(flat, grids)]
