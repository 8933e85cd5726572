"""RMSNorm and Block, the pre-norm residual block both models stack: each against its formula
in float64 numpy (tests/layer_formula_checks.py), the norm's gain starting at ones."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from neurips26_jax.models.block import Block
from neurips26_jax.models.norm import RMSNorm
from tests.layer_formula_checks import P, close, normal, randomize, rms_norm, run


def test_rmsnorm_formula_and_init():
  norm = RMSNorm(16)
  np.testing.assert_array_equal(norm.scale[...], np.ones(16))
  randomize(norm.scale, 0)
  x = normal(1, (3, 5, 16)) * 3.0
  close(run(norm, x.astype(np.float32)), rms_norm(x, P(norm.scale)))


class _Linear(nnx.Module):
  """A toy token-wise layer with a decoding step: y = (x + sum(context)) W."""

  def __init__(self, d, key):
    self.w = nnx.Param(jnp.asarray(normal(key, (d, d)) / math.sqrt(d), jnp.float32))

  def __call__(self, x, *context):
    return (x + sum(context)) @ self.w[...]

  def step(self, x_t, cache):
    return x_t @ self.w[...], cache + 1


def test_block_is_pre_norm_residual():
  """Block: x = x + mixer(RMSNorm1(x), *context); x = x + ffn(RMSNorm2(x)); and `step` the
  same token by token."""
  d = 8
  block = Block(_Linear(d, 1), _Linear(d, 2), d)
  randomize(block.norm1.scale, 3)
  randomize(block.norm2.scale, 4)
  x = normal(5, (2, 3, d)) * 2
  extra = normal(6, (2, 3, d))
  wm, wf = P(block.mixer.w), P(block.ffn.w)
  h = x + (rms_norm(x, P(block.norm1.scale)) + extra) @ wm
  expected = h + rms_norm(h, P(block.norm2.scale)) @ wf
  close(run(block, x.astype(np.float32), extra.astype(np.float32)), expected)
  y_t, cache = nnx.jit(lambda m, x_t: m.step(x_t, jnp.zeros(())))(
      block, jnp.asarray(x[:, 0], jnp.float32))
  h_t = x[:, 0] + rms_norm(x[:, 0], P(block.norm1.scale)) @ wm
  close(y_t, h_t + rms_norm(h_t, P(block.norm2.scale)) @ wf)
  assert int(cache) == 1
