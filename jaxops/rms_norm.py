"""RMS normalization without a gain, with a backward that keeps only its output.

  y = x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps)           (over the last axis)
  dx = rstd * (dy - y * mean(dy * y))

Plain autodiff keeps x (or x in float32) for the backward; this keeps y and rstd, and y
is usually saved by the next op anyway (FlashFFN's kernel saves its q), so the two
residuals share one buffer. Folding the gain into the next matmul's weights is the
caller's job.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops import checks


@jax.custom_vjp
def rms_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
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


# ----------------------------------------------------------------------------
# Per-group RMS normalization of a flat last axis, as 2-D matmuls.
# ----------------------------------------------------------------------------

def _group_matrix(width: int, groups: int):
  """P [width, groups] float32: P[i, g] = 1 where feature i is in group g."""
  return (jnp.arange(width)[:, None] // (width // groups) == jnp.arange(groups)).astype(
      jnp.float32)


def _group_sum(a, groups: int):
  """[..., G * D] -> [..., G] float32: per-group sums (a matmul, float32 accumulation)."""
  return jnp.dot(a, _group_matrix(a.shape[-1], groups).astype(a.dtype),
                 preferred_element_type=jnp.float32)


def _expand_matmul(v, width: int, dtype):
  return jnp.dot(v, _group_matrix(width, v.shape[-1]).T,
                 preferred_element_type=jnp.float32).astype(dtype)


def _expand_repeat(v, width: int, dtype):
  return jnp.repeat(v, width // v.shape[-1], axis=-1).astype(dtype)


def _expand(v, width: int, dtype=jnp.float32):
  """[..., G] -> [..., width] in `dtype`: each group's value over its features.

  On TPU a matmul with the 0/1 group matrix: as a broadcast XLA re-derived a [..., G, D]
  layout and copied around it. Elsewhere a repeat: on the GPU compile the matmul's f32
  [..., width] output was kept for the backward (H100, 370M layer, bf16: 1.4-1.5x more
  temp memory than with the repeat).
  """
  return jax.lax.platform_dependent(
      v, tpu=functools.partial(_expand_matmul, width=width, dtype=dtype),
      default=functools.partial(_expand_repeat, width=width, dtype=dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def rms_normalize_groups(x: jax.Array, groups: int, eps: float = 1e-6) -> jax.Array:
  """x [..., G * D] -> each group of D features over its own RMS, in x.dtype.

  The same math as `rms_normalize` on x reshaped to [..., G, D], kept flat: the group
  statistics are small matmuls, so no [..., G, D]-shaped reduction makes XLA pick a
  transposed layout (on TPU that cost several [L, d] float32 buffers in FlashFFN's
  backward). Residuals: the output and rstd [..., G].
  """
  return _group_forward(x, groups, eps)[0]


def _group_forward(x, groups, eps):
  checks.ints("rms_normalize_groups", {"groups": groups})
  width = x.shape[-1]
  checks.multiple("rms_normalize_groups", "the last dim of `x`", width, groups, "`groups`")
  ss = _group_sum(x.astype(jnp.float32) * x.astype(jnp.float32), groups)
  rstd = jax.lax.rsqrt(ss / (width // groups) + eps)                    # [..., G]
  return (x.astype(jnp.float32) * _expand(rstd, width)).astype(x.dtype), rstd


def _group_fwd(x, groups, eps):
  y, rstd = _group_forward(x, groups, eps)
  return y, (y, rstd)


def _group_bwd(groups, eps, residuals, dy):
  # The barrier keeps XLA from sharing this expansion of rstd with the forward's, which
  # would keep an [..., G * D] float32 buffer alive from forward to backward.
  y, rstd = jax.lax.optimization_barrier(residuals)
  width = y.shape[-1]
  y32, dy32 = y.astype(jnp.float32), dy.astype(jnp.float32)
  mean = _group_sum(dy32 * y32, groups) / (width // groups)
  # mean * y is a small correction to dy: its expansion in y's dtype halves the one
  # [..., G * D] buffer XLA may materialize here (bf16 at 32k tokens: 128 -> 64 MiB).
  dx = _expand(rstd, width) * (dy32 - y32 * _expand(mean, width, y.dtype))
  return (dx.astype(y.dtype),)


rms_normalize_groups.defvjp(_group_fwd, _group_bwd)
