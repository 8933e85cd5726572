"""RMS normalization without a gain, with a backward that keeps only its output.

  y = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)           (over the last axis)
  dx = rstd * (dy - y * mean(dy * y))

Plain autodiff keeps x (or x in float32) for the backward; this keeps y and rstd, and y
is usually saved by the next op anyway (FlashFFN's kernel saves its q), so the two
residuals share one buffer. Folding the gain into the next matmul's weights is the
caller's job.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def rms_normalize(x, eps: float = 1e-6):
  """x [..., D] -> x / sqrt(mean(x^2, -1) + eps) in x.dtype (statistics in float32)."""
  return _forward(x, eps)[0]


def _forward(x, eps):
  x32 = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * rstd).astype(x.dtype), rstd


def _fwd(x, eps):
  y, rstd = _forward(x, eps)
  return y, (y, rstd)


def _bwd(residuals, dy):
  y, rstd = residuals
  y32, dy32 = y.astype(jnp.float32), dy.astype(jnp.float32)
  dx = rstd * (dy32 - y32 * jnp.mean(dy32 * y32, axis=-1, keepdims=True))
  return dx.astype(y.dtype), None


rms_normalize.defvjp(_fwd, _bwd)
