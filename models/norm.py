"""RMSNorm as an NNX layer: y = x / sqrt(mean(x^2) + eps) * scale, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.models.partitioning import scale


class RMSNorm(nnx.Module):
  """x [..., d] -> same shape and dtype; the statistics are float32; `scale` [d] starts at ones."""

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype: DTypeLike = jnp.float32) -> None:
    checks.ints("RMSNorm", {"dim": dim})
    if not eps > 0:
      raise ValueError(f"RMSNorm: `eps` must be > 0, got {eps!r}")
    self.eps = eps
    self.scale = scale(jnp.ones((dim,), param_dtype), "channels")

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., dim] -> same shape and dtype."""
    dim = self.scale.shape[0]
    if x.ndim < 1 or x.shape[-1] != dim:
      raise ValueError(f"RMSNorm: `x` must be [..., dim={dim}], got shape {x.shape}")
    checks.floating("RMSNorm", "x", x)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
