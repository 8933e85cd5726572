"""UNet3D: a plain 3D U-Net baseline for dense volumes.

  image [B, Z, Y, X, C] -> level 0..L-1 encoder (two 3x3x3 conv + RMSNorm + SiLU, channels
  base * 2^l), 2x2x2 max-pool between levels -> decoder (2x2x2 transposed conv up, concat the
  skip, two convs) -> 1x1x1 conv -> logits [B, Z, Y, X, K] float32.
Z, Y, X must be divisible by 2^(L-1). `unet3d_matching` picks `base_channels` so the parameter
count is closest to a given one (e.g. a Pack3DSegmenter's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.models.norm import RMSNorm
from neurips26_jax.models.partitioning import axes_metadata


def _conv(conv_class, c_in: int, c_out: int, kernel_size, **kwargs) -> nnx.Module:
  """An nnx conv whose kernel [k, k, k, c_in, c_out] and bias [c_out] carry logical axes
  (models.partitioning): input channels "embed" (fsdp), output channels "mlp" (tensor)."""
  return conv_class(c_in, c_out, kernel_size, **kwargs,
                    kernel_metadata=axes_metadata(None, None, None, "embed", "mlp"),
                    bias_metadata=axes_metadata("channels"))


class ConvBlock(nnx.Module):
  """Two (3x3x3 conv -> RMSNorm over channels -> SiLU)."""

  def __init__(self, c_in: int, c_out: int, *, dtype: DTypeLike | None,
               rngs: nnx.Rngs) -> None:
    self.convs = nnx.List([_conv(nnx.Conv, c, c_out, (3, 3, 3), dtype=dtype, rngs=rngs)
                           for c in (c_in, c_out)])
    self.norms = nnx.List([RMSNorm(c_out), RMSNorm(c_out)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for conv, norm in zip(self.convs, self.norms):
      x = jax.nn.silu(norm(conv(x)))
    return x


def _pool(x):
  b, z, y, w, c = x.shape
  return x.reshape(b, z // 2, 2, y // 2, 2, w // 2, 2, c).max(axis=(2, 4, 6))


class UNet3D(nnx.Module):
  """Dense 3D U-Net: image [B, Z, Y, X, C] -> logits [B, Z, Y, X, K] float32 (module docstring).

  Args: in_channels C, num_classes K, base_channels, levels L (>= 1), dtype (compute).
  No kernel (no `impl`).
  """

  def __init__(self, *, in_channels: int = 1, num_classes: int, base_channels: int = 16,
               levels: int = 3, dtype: DTypeLike | None = None, rngs: nnx.Rngs) -> None:
    checks.ints("UNet3D", dict(in_channels=in_channels, num_classes=num_classes,
                               base_channels=base_channels, levels=levels))
    ch = [base_channels * 2 ** l for l in range(levels)]
    self.levels, self.dtype = levels, dtype
    self.down = nnx.List([ConvBlock(c_in, c, dtype=dtype, rngs=rngs)
                          for c_in, c in zip([in_channels] + ch[:-1], ch)])
    self.up = nnx.List([_conv(nnx.ConvTranspose, ch[l + 1], ch[l], (2, 2, 2), strides=(2, 2, 2),
                              dtype=dtype, rngs=rngs) for l in range(levels - 1)])
    self.merge = nnx.List([ConvBlock(2 * ch[l], ch[l], dtype=dtype, rngs=rngs)
                           for l in range(levels - 1)])
    self.out = _conv(nnx.Conv, ch[0], num_classes, (1, 1, 1), dtype=dtype, rngs=rngs)

  def __call__(self, image: jax.Array) -> jax.Array:
    """image [B, Z, Y, X, C] -> logits [B, Z, Y, X, K] float32."""
    factor, channels = 2 ** (self.levels - 1), self.down[0].convs[0].in_features
    if (image.ndim != 5 or image.shape[-1] != channels or 0 in image.shape
        or any(n % factor for n in image.shape[1:4])):
      raise ValueError(f"UNet3D: `image` must be [B, Z, Y, X, C={channels}] with Z, Y, X"
                       f" positive and divisible by {factor}, got {image.shape}")
    x, skips = image.astype(self.dtype or jnp.float32), []
    for l, block in enumerate(self.down):
      x = block(_pool(x) if l else x)
      skips.append(x)
    for l in reversed(range(self.levels - 1)):
      x = self.merge[l](jnp.concatenate([self.up[l](x), skips[l]], axis=-1))
    return self.out(x).astype(jnp.float32)


def param_count(model: nnx.Module) -> int:
  """The number of parameter entries of any NNX model."""
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def unet3d_matching(num_params: int, *, levels: int = 3, in_channels: int = 1,
                    num_classes: int) -> int:
  """The base_channels (1..256) whose UNet3D parameter count is closest to num_params.

  The count is exactly quadratic in base_channels; it is fitted through three built models.
  """
  def count(base):
    return param_count(nnx.eval_shape(lambda: UNet3D(
        in_channels=in_channels, num_classes=num_classes, base_channels=base, levels=levels,
        rngs=nnx.Rngs(0))))
  quadratic = np.polyfit([1, 2, 3], [count(b) for b in (1, 2, 3)], 2)
  bases = np.arange(1, 257)
  return int(bases[np.argmin(np.abs(np.polyval(quadratic, bases) - num_params))])
