"""What the layer-formula tests share: each layer in models/ rebuilt from its parameters by
the formula its docstring or DESIGN.md states, in float64 numpy that shares no code with the
project, and its initial parameters checked against the stated initialisation. Each layer's
tests (and the formulas only it uses) sit with its other tests: test_block.py,
test_flash_ffn.py, test_pack3d_layer.py, test_frac_model.py, test_lm.py, test_seg3d.py.

The equivalence tests elsewhere compare one implementation of an op with another; they cannot
see how a layer turns its input and parameters into the op's arguments (projections, positional
frequencies, dt, skips, norm placement, defaults). These tests can. Parameters that start at
ones or zeros (norm gains, biases, skips) are randomised first (`randomize`), so using the
wrong one shows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

RTOL = 2e-5  # float32 layers against float64 formulas, relative to max|expected|


def rngs():
  return nnx.Rngs(jax.random.key(0, impl="rbg"))  # its initialisers compile ~4x faster


def build(cls, *args, **kwargs):
  """cls(*args, **kwargs, rngs=rngs()) initialised under one jit (eagerly, every
  initialiser compiles its own program)."""
  return nnx.jit(lambda: cls(*args, **kwargs, rngs=rngs()))()


def run(layer, *args):
  """layer(*args) under one jit (eager op-by-op dispatch compiles every op separately)."""
  return nnx.jit(lambda m, *a: m(*a))(layer, *(jnp.asarray(a) for a in args))


# ----------------------------------------------------------------------------- numpy math

def P(param):
  return np.asarray(param[...], np.float64)


def normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape)


def silu(x):
  return x / (1.0 + np.exp(-x))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
  return np.logaddexp(0.0, x)


def rms_norm(x, gain=1.0, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gain


def softmax(z):
  e = np.exp(z - z.max())
  return e / e.sum()


def swiglu_numpy(layer, x):
  return (silu(x @ P(layer.w_gate)) * (x @ P(layer.w_up))) @ P(layer.w_down)


def rotate_half_pairs(x, angles):
  """Rotates the pairs (x_k, x_{m+k}) of x [..., 2m] by angles [..., m] (DESIGN.md, jaxops/rope)."""
  m = x.shape[-1] // 2
  x1, x2 = x[..., :m], x[..., m:]
  return np.concatenate([x1 * np.cos(angles) - x2 * np.sin(angles),
                         x1 * np.sin(angles) + x2 * np.cos(angles)], axis=-1)


def rope_1d(x, positions, theta=10000.0):
  """x [B, L, H, D], positions [L]: angle p theta^(-k/m), m = D/2."""
  m = x.shape[-1] // 2
  freqs = np.array([theta ** (-k / m) for k in range(m)])
  return rotate_half_pairs(x, positions[None, :, None, None] * freqs)


def axial_rope(x, coords, theta=10000.0, spacing=(1.0, 1.0, 1.0)):
  """x [B, N, H, D], coords [B, N, 3]: part a (width D/3) is a 1D RoPE at p_a s_a, m = D/6."""
  part, m = x.shape[-1] // 3, x.shape[-1] // 6
  freqs = np.array([theta ** (-k / m) for k in range(m)])
  pieces = [rotate_half_pairs(x[..., a * part:(a + 1) * part],
                              (coords[..., a] * spacing[a])[:, :, None, None] * freqs)
            for a in range(3)]
  return np.concatenate(pieces, axis=-1)


def pack3d_attention(q, k, v, coords, field_ids, block=(4, 4, 4), radius=1):
  """DESIGN.md section 3 for rotated q, k [B, N, H, D]: one softmax over the query's near
  tokens (cube distance <= radius, own field) and the mean-summaries of its far cubes,
  with the log(n_b) bias."""
  out = np.zeros_like(q)
  d = q.shape[-1]
  for b in range(q.shape[0]):
    cube = coords[b] // np.asarray(block)
    for i in range(q.shape[1]):
      same = field_ids[b] == field_ids[b, i]
      dist = np.max(np.abs(cube - cube[i]), axis=-1)
      near = np.flatnonzero(same & (dist <= radius))
      far_cubes = {tuple(c) for c in cube[same & (dist > radius)]}
      for h in range(q.shape[2]):
        keys, vals, bias = list(k[b, near, h]), list(v[b, near, h]), [0.0] * len(near)
        for c in far_cubes:
          members = same & np.all(cube == c, axis=-1)
          keys.append(k[b, members, h].mean(0))
          vals.append(v[b, members, h].mean(0))
          bias.append(math.log(members.sum()))
        p = softmax(np.asarray(keys) @ q[b, i, h] / math.sqrt(d) + np.asarray(bias))
        out[b, i, h] = p @ np.asarray(vals)
  return out


def pack3d_layer_numpy(layer, x, coords, field_ids, heads):
  """Pack3DAttention's docstring with its defaults: q, k, v = x W_qkv (W_qkv [d, 3, H D]),
  axial RoPE of q and k on the coordinates (theta 10000), rotated BEFORE compression,
  Pack3D attention with 4^3 cubes, radius 1 and the log(n_b) bias, then W_out."""
  b, n, d = x.shape
  qkv = np.einsum("bnd,dkf->bnkf", x, P(layer.w_qkv)).reshape(b, n, 3, heads, d // heads)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  q, k = axial_rope(q, coords), axial_rope(k, coords)
  o = pack3d_attention(q, k, v, coords, field_ids)
  return o.reshape(b, n, d) @ P(layer.w_out)


def close(actual, expected, rtol=RTOL, name=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  err, scale = np.max(np.abs(actual - expected)), np.max(np.abs(expected))
  assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


def randomize(param, seed, center=1.0, spread=0.5):
  """Moves a parameter that starts constant (gain, bias, skip) to random values."""
  value = center + spread * np.random.default_rng(seed).standard_normal(param[...].shape)
  param[...] = jnp.asarray(value, param[...].dtype)


def stats_match(w, *, std, mean=0.0, bound=None, name=""):
  """Sample mean and std within a few standard errors of a N(mean, std)-like init."""
  w = np.asarray(w, np.float64).ravel()
  se = std / math.sqrt(w.size)
  assert abs(w.mean() - mean) < 5 * se + 1e-12, (name, w.mean())
  assert abs(w.std() / std - 1) < 5 / math.sqrt(2 * w.size) + 0.02, (name, w.std(), std)
  if bound is not None:
    assert np.max(np.abs(w - mean)) <= bound * (1 + 1e-6), (name, np.max(np.abs(w)), bound)


def grid(shape):
  return np.stack(np.meshgrid(*(np.arange(n) for n in shape), indexing="ij"), -1).reshape(-1, 3)


def two_fields(seed=0):
  """coords [1, N, 3], field_ids [1, N]: a 12x4x8 field (3x1x2 cubes of 4^3, so some cubes
  are far apart) and a partial-cube 5x6x3 field, in a shuffled packing order."""
  coords = np.concatenate([grid((12, 4, 8)), grid((5, 6, 3))])
  field_ids = np.repeat([0, 1], [12 * 4 * 8, 5 * 6 * 3])
  perm = np.random.default_rng(seed).permutation(len(coords))
  return coords[perm][None].astype(np.int32), field_ids[perm][None].astype(np.int32)
