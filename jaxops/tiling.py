"""Small helpers for tiled math, shared by the chunked XLA paths and the Pallas kernels.

Matmuls accumulate in float32 whatever the input dtype (bf16 inputs stay bf16 on the
MXU / tensor cores); the transposed forms are dot_generals that Mosaic and Triton lower
without materializing a transpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def dot(a, b, precision=None):
  """a @ b, [m, k] x [k, n] -> [m, n] float32."""
  return jnp.dot(a, b, precision=precision, preferred_element_type=_F32)


def dot_nt(a, b, precision=None):
  """a @ b^T, [m, k] x [n, k] -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=_F32)


def dot_tn(a, b, precision=None):
  """a^T @ b, [k, m] x [k, n] -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=_F32)


def round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def next_pow2(x: int, minimum: int = 16) -> int:
  """The smallest power of two >= max(x, minimum) (Triton block sizes; tl.dot needs >= 16)."""
  return max(minimum, 1 << max(0, x - 1).bit_length())
