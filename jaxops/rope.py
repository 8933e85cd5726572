"""Rotary position embeddings: plain 1D RoPE and axial 3D RoPE on grid coordinates.

A rotary embedding of width 2m rotates the pairs (x_k, x_{m+k}), k = 0..m-1, by the
angle p * theta^(-k/m) for a position p::

  R(p) [x1; x2] = [x1 cos(a) - x2 sin(a);  x1 sin(a) + x2 cos(a)],   a_k = p theta^(-k/m)

Rotations compose additively, R(p)^T R(p') = R(p' - p), so the logit
(R(p_i) q) . (R(p_j) k) depends only on p_j - p_i.

Axial 3D RoPE (DESIGN.md section 3) splits the head dimension D into three equal parts
of width D/3 (D % 6 == 0); part a (a = z, y, x) is a 1D RoPE of width 2 m_a, m_a = D/6,
on the position p_a * s_a, with s the voxel spacing. The logit then depends only on the
3D offset p_j - p_i, whatever order the tokens are packed in.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from neurips26_jax.jaxops import checks

_F32 = jnp.float32


def _check_x_and_theta(owner: str, x, theta) -> None:
  checks.floating(owner, "x", x)
  if not theta > 0:
    raise ValueError(f"{owner}: `theta` must be > 0, got {theta!r}")


def rotate(x: jax.Array, angles: jax.Array) -> jax.Array:
  """Rotates the pairs (x[..., k], x[..., m + k]) of x [..., 2m] by angles [..., m] (float32)."""
  m = x.shape[-1] // 2
  x1, x2 = x[..., :m].astype(_F32), x[..., m:].astype(_F32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def rope_angles(positions: jax.Array, width: int, theta: float) -> jax.Array:
  """Angles p * theta^(-k/m), k = 0..m-1, for a rotary part of `width` = 2m: [..., m] float32."""
  m = width // 2
  freqs = theta ** (-jnp.arange(m, dtype=_F32) / m)
  return positions.astype(_F32)[..., None] * freqs


def rope_1d(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0) -> jax.Array:
  """1D RoPE over a sequence index (the packed-sequence baseline).

  Args:
    x: [..., N, H, D] with D even.
    positions: [..., N] (integer or float), one position per token, shared by all heads.
  """
  if x.ndim < 3 or x.shape[-1] % 2:
    raise ValueError(f"rope_1d: `x` must be [..., N, H, D] with D even, got shape {x.shape}")
  _check_x_and_theta("rope_1d", x, theta)
  if positions.shape != x.shape[:-2]:
    raise ValueError(f"rope_1d: `positions` has shape {positions.shape}; expected"
                     f" {x.shape[:-2]} (the token axes of x {x.shape})")
  return rotate(x, rope_angles(positions, x.shape[-1], theta)[..., None, :])


def axial_rope_3d_float(x: jax.Array, positions: jax.Array, *, theta: float = 10000.0,
                        spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> jax.Array:
  """`axial_rope_3d` at real-valued positions [..., N, 3] (no input checks).

  Used for rotations at non-grid points, e.g. a cube's mean position or -p (R(-p) = R(p)^-1).
  """
  part = x.shape[-1] // 3
  scaled = positions.astype(_F32) * jnp.asarray(spacing, _F32)
  pieces = [rotate(x[..., a * part:(a + 1) * part],
                   rope_angles(scaled[..., a], part, theta)[..., None, :]) for a in range(3)]
  return jnp.concatenate(pieces, axis=-1)


def axial_rope_3d(x: jax.Array, coords: ArrayLike, *, theta: float = 10000.0,
                  spacing: Sequence[float] = (1.0, 1.0, 1.0)) -> jax.Array:
  """Axial 3D RoPE on integer grid coordinates.

  Args:
    x: [..., N, H, D] queries or keys, D divisible by 6.
    coords: integer [..., N, 3], the (z, y, x) grid position of each token in its field.
    theta: base of the frequencies theta^(-k/m_a).
    spacing: voxel spacing (s_z, s_y, s_x); positions are p_a * s_a.

  Returns:
    x rotated, same shape and dtype (rotation computed in float32).
  """
  if x.ndim < 3 or x.shape[-1] % 6:
    raise ValueError(
        f"axial_rope_3d: `x` must be [..., N, H, D] with D divisible by 6, got shape {x.shape}")
  _check_x_and_theta("axial_rope_3d", x, theta)
  if coords.shape != x.shape[:-2] + (3,):
    raise ValueError(f"axial_rope_3d: `coords` has shape {coords.shape}; expected"
                     f" {x.shape[:-2] + (3,)} from x {x.shape}")
  checks.integer("axial_rope_3d", "coords", coords)
  if np.shape(spacing) != (3,) or not np.all(np.isfinite(spacing)):
    raise ValueError(f"axial_rope_3d: `spacing` must be 3 finite numbers, got {spacing!r}")
  return axial_rope_3d_float(x, coords, theta=theta, spacing=spacing)
