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


def seq_chunks(x, chunk: int):
  """x [B, L, ...] -> [ceil(L / chunk), B, chunk, ...]: L zero-padded to whole chunks, the
  chunks leading (for `jax.lax.map` / `scan` over them)."""
  batch, length = x.shape[:2]
  steps = -(-length // chunk)
  x = jnp.pad(x, ((0, 0), (0, steps * chunk - length)) + ((0, 0),) * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(batch, steps, chunk, *x.shape[2:]), 1, 0)


def seq_unchunk(x, length: int):
  """`seq_chunks`' inverse: [steps, B, chunk, ...] -> [B, length, ...], the padding dropped."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]
