"""Every layer in models/ rebuilt from its parameters by the formula its docstring or DESIGN.md
states, in float64 numpy that shares no code with the project; and its initial parameters
checked against the stated initialisation.

The equivalence tests elsewhere compare one implementation of an op with another; they cannot
see how a layer turns its input and parameters into the op's arguments (projections, positional
frequencies, dt, skips, norm placement, defaults). These tests can. Parameters that start at
ones or zeros (norm gains, biases, skips) are randomised first, so using the wrong one shows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from scipy.special import gammaln

from models import FlashFFN, FRACMixer, Pack3DAttention, SwiGLU
from models.attention import CausalAttention
from models.block import Block
from models.lm import LanguageModel
from models.norm import RMSNorm
from models.seg3d import Pack3DSegmenter
from models.unet3d import UNet3D

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


# ----------------------------------------------------------------------------- norms, FFNs

def test_rmsnorm_formula_and_init():
  norm = RMSNorm(16)
  np.testing.assert_array_equal(norm.scale[...], np.ones(16))
  randomize(norm.scale, 0)
  x = normal(1, (3, 5, 16)) * 3.0
  close(run(norm, x.astype(np.float32)), rms_norm(x, P(norm.scale)))


def test_swiglu_formula_and_init():
  layer = build(SwiGLU, 32, 48)
  x = normal(1, (2, 7, 32))
  expected = (silu(x @ P(layer.w_gate)) * (x @ P(layer.w_up))) @ P(layer.w_down)
  close(run(layer, x.astype(np.float32)), expected)
  # lecun_normal: std 1/sqrt(fan_in)
  for name, fan_in in (("w_gate", 32), ("w_up", 32), ("w_down", 48)):
    stats_match(getattr(layer, name)[...], std=fan_in ** -0.5, name=name)


def flashffn_numpy(layer, x, heads):
  """DESIGN.md section 2, steps 1-5, with the per-head RMSNorm (default on) and its gain."""
  b, l, d = x.shape
  d_h = d // heads
  q = (x @ P(layer.w_in)).reshape(b, l, heads, d_h)
  q = rms_norm(q, P(layer.norm_gain))
  out = np.zeros((b, l, heads, d_h))
  k, u, v, router = P(layer.k), P(layer.u), P(layer.v), P(layer.router)
  for h in range(heads):
    sig = sigmoid(q[:, :, h] @ router[h])                       # [b, l, E]
    r = sig / np.maximum(sig.sum(-1, keepdims=True), 1e-20)
    for e in range(k.shape[1]):
      a = silu(q[:, :, h] @ k[h, e].T) * (q[:, :, h] @ u[h, e].T)
      out[:, :, h] += r[..., e:e + 1] * (a @ v[h, e])
  return out.reshape(b, l, d) @ P(layer.w_out)


def test_flashffn_formula_with_defaults():
  """Defaults (head norm on) and the formula, through the layer's fast XLA path."""
  layer = build(FlashFFN, 32, 2, 3, 16, impl="xla")
  randomize(layer.norm_gain, 1)
  layer.router[...] = layer.router[...] * 50   # a router far from uniform
  x = normal(2, (2, 9, 32))
  close(run(layer, x.astype(np.float32)), flashffn_numpy(layer, x, heads=2))


def test_flashffn_paper_init():
  """init="paper": W_in, W_out Xavier-uniform gain 0.707; K, U, V normal(0, 0.02); router
  truncated normal(0, 0.02) (cut at 2 sigma); norm gain ones (DESIGN.md section 2)."""
  d, heads, experts, d_e = 128, 2, 4, 64
  layer = build(FlashFFN, d, heads, experts, d_e, init="paper")
  bound = 0.707 * math.sqrt(6 / (d + d))
  for name in ("w_in", "w_out"):
    stats_match(getattr(layer, name)[...], std=bound / math.sqrt(3), bound=bound, name=name)
  for name in ("k", "u", "v"):
    stats_match(getattr(layer, name)[...], std=0.02, name=name)
  router = np.asarray(layer.router[...])
  assert router.shape == (heads, d // heads, experts)
  # jax's truncated_normal(0.02) has std 0.02 and support +-2 * 0.02 / 0.8796
  stats_match(router, std=0.02, bound=2 * 0.02 / 0.87962566103423978, name="router")
  np.testing.assert_array_equal(layer.norm_gain[...], np.ones((heads, d // heads)))


def test_flashffn_scaled_init():
  """The default init (models/flash_ffn.py): W_in, W_out LeCun normal N(0, 1/d) (truncated at
  2 sigma, std exactly 1/sqrt(d)); K, U ~ N(0, 1/d_h); V ~ N(0, E/d_e); router as the paper's."""
  d, heads, experts, d_e = 128, 2, 4, 64
  layer = build(FlashFFN, d, heads, experts, d_e)
  for name in ("w_in", "w_out"):
    stats_match(getattr(layer, name)[...], std=d ** -0.5,
                bound=2 * d ** -0.5 / 0.87962566103423978, name=name)
  for name in ("k", "u"):
    stats_match(getattr(layer, name)[...], std=(d // heads) ** -0.5, name=name)
  stats_match(layer.v[...], std=math.sqrt(experts / d_e), name="v")
  stats_match(layer.router[...], std=0.02, bound=2 * 0.02 / 0.87962566103423978, name="router")


# ----------------------------------------------------------------------------- attention

def causal_attention_numpy(layer, x, theta=10000.0):
  """models/attention.py's docstring: projections, 1D RoPE on t = 0..L-1, causal softmax."""
  wq, wk, wv, wo = (P(w) for w in (layer.wq, layer.wk, layer.wv, layer.wo))
  q, k, v = (np.einsum("bld,dhk->blhk", x, w) for w in (wq, wk, wv))
  positions = np.arange(x.shape[1], dtype=np.float64)
  q, k = rope_1d(q, positions, theta), rope_1d(k, positions, theta)
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  logits = np.where(np.tril(np.ones((x.shape[1],) * 2, bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum("bhqk,bkhd->bqhd", probs, v)
  return np.einsum("bqhd,hdm->bqm", o, wo)


def test_causal_attention_formula_and_init():
  layer = build(CausalAttention, 32, 2, context=64)
  x = normal(1, (2, 40, 32))
  close(run(layer, x.astype(np.float32)), causal_attention_numpy(layer, x))
  for name in ("wq", "wk", "wv", "wo"):     # normal(0, d^-1/2)
    stats_match(getattr(layer, name)[...], std=32 ** -0.5, name=name)


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


def test_pack3d_attention_formula_with_defaults():
  coords, field_ids = two_fields()
  layer = build(Pack3DAttention, 36, 2, impl="xla")   # head dim 18: m = 3 per axis
  x = normal(1, coords.shape[:2] + (36,))
  got = nnx.jit(lambda m, x: m(x, coords, field_ids))(layer, jnp.asarray(x, jnp.float32))
  close(got, pack3d_layer_numpy(layer, x, coords, field_ids, heads=2))


def test_pack3d_attention_init():
  """Xavier-uniform (gain 1) W_qkv [d, 3d] (stored [d, 3, d]) and W_out [d, d]."""
  d = 96
  layer = build(Pack3DAttention, d, 2)
  assert layer.w_qkv.shape == (d, 3, d)
  for name, fan_out in (("w_qkv", 3 * d), ("w_out", d)):
    bound = math.sqrt(6 / (d + fan_out))
    stats_match(getattr(layer, name)[...], std=bound / math.sqrt(3), bound=bound, name=name)


# ----------------------------------------------------------------------------- FRAC

def soe_modes_numpy(alpha, context):
  """DESIGN.md section 4 / jaxops.frac.soe_modes' docstring: M = ceil(ln(4 context / 0.03)) + 2
  modes; G = M - 1 log-spaced rates over [0.03 / context, 4] (step h), weights
  h exp(a ln s - s - lnGamma(a)); a tail mode of weight b^a / Gamma(a + 1) and rate
  b a / (a + 1), b = s_min e^(-h/2), first."""
  modes = math.ceil(math.log(4.0 * context / 0.03)) + 2
  g = modes - 1
  s_min = 0.03 / context
  h = math.log(4.0 / s_min) / (g - 1)
  s = s_min * np.exp(h * np.arange(g))
  a = np.asarray(alpha, np.float64)[:, None]
  w = h * np.exp(a * np.log(s) - s - gammaln(a))
  b = s_min * math.exp(-h / 2)
  rates = np.concatenate([b * a / (a + 1), np.broadcast_to(s, w.shape)], -1)
  weights = np.concatenate([np.exp(a * math.log(b) - gammaln(a + 1)), w], -1)
  return rates, weights


def frac_mixer_numpy(layer, x, num_heads, head_dim, state_dim, context, alpha_min=0.05,
                     selective_dt=True):
  """FRACMixer's docstring, defaults (conv width 4, alpha_min 0.05), Mamba-2 style layout:
  in_proj [d, 2, d_in] gives z and x, bc_proj [d, 2N] B and C, dt_proj [d, H] dt; the causal
  conv runs over x (conv_weight) and B, C (bc_conv_weight). selective_dt=False: no dt_proj,
  dt_h = softplus(dt_bias_h) at every token."""
  bsz, length, _ = x.shape
  heads, d_in, n = num_heads, num_heads * head_dim, state_dim
  zx = np.einsum("bld,dkc->blkc", x, P(layer.in_proj))
  z = zx[..., 0, :]
  xbc = np.concatenate([zx[..., 1, :], x @ P(layer.bc_proj)], -1)
  dt_raw = x @ P(layer.dt_proj) if selective_dt else np.zeros((bsz, length, heads))
  w = np.concatenate([P(layer.conv_weight), P(layer.bc_conv_weight)], 1)  # [width, channels]
  padded = np.concatenate([np.zeros((bsz, w.shape[0] - 1, xbc.shape[-1])), xbc], 1)
  conv = sum(padded[:, j:j + length] * w[j] for j in range(w.shape[0]))
  xbc = silu(conv + np.concatenate([P(layer.conv_bias), P(layer.bc_conv_bias)]))
  xs = xbc[..., :d_in].reshape(bsz, length, heads, head_dim)
  bmat, cmat = xbc[..., d_in:d_in + n], xbc[..., d_in + n:]  # shared by the heads
  dt = softplus(dt_raw + P(layer.dt_bias))                  # [B, L, H]
  alpha = alpha_min + (1 - alpha_min) * sigmoid(P(layer.alpha_logit))
  rates, weights = soe_modes_numpy(alpha, context)
  rates = rates * np.exp(P(layer.log_timescale))[:, None]   # c_h
  state = np.zeros((bsz, heads, rates.shape[1], n, head_dim))
  y = np.zeros((bsz, length, heads, head_dim))
  for t in range(length):
    decay = np.exp(-rates[None] * dt[:, t, :, None])        # [B, H, M]
    update = np.einsum("bh,bn,bhp->bhnp", dt[:, t], bmat[:, t], xs[:, t])
    state = decay[..., None, None] * state + update[:, :, None]
    y[:, t] = np.einsum("hm,bn,bhmnp->bhp", weights, cmat[:, t], state)
  y = y + P(layer.skip)[:, None] * xs                       # D x
  y = y.reshape(bsz, length, d_in) * silu(z)               # gate, then the norm
  return rms_norm(y, P(layer.norm_gain)) @ P(layer.out_proj)


FRAC = dict(num_heads=3, head_dim=8, state_dim=4, context=64)


def test_frac_mixer_formula_with_defaults():
  layer = build(FRACMixer, 16, **FRAC)          # impl "xla", default num_modes
  for i, name in enumerate(("skip", "norm_gain", "conv_bias", "bc_conv_bias", "log_timescale",
                            "dt_bias")):
    randomize(getattr(layer, name), 10 + i, center=0.0 if "conv_bias" in name else 1.0)
  layer.log_timescale[...] = layer.log_timescale[...] - 1.0
  layer.alpha_logit[...] = jnp.array([-1.5, 0.3, 2.0])
  x = normal(1, (2, 37, 16))
  got = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x, jnp.float32))
  close(got, frac_mixer_numpy(layer, x, **FRAC), rtol=5e-5)


def test_frac_mixer_without_selective_dt():
  """selective_dt=False: the layer has no dt_proj and dt_h = softplus(dt_bias_h) at every
  token; everything else is the default formula."""
  layer = build(FRACMixer, 16, selective_dt=False, **FRAC)
  assert layer.dt_proj is None
  for i, name in enumerate(("skip", "norm_gain", "log_timescale", "dt_bias")):
    randomize(getattr(layer, name), 30 + i)
  layer.alpha_logit[...] = jnp.array([-1.5, 0.3, 2.0])
  x = normal(2, (2, 29, 16))
  got = nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x, jnp.float32))
  close(got, frac_mixer_numpy(layer, x, **FRAC, selective_dt=False), rtol=5e-5)
  count = lambda m: sum(v.size for v in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert count(build(FRACMixer, 16, **FRAC)) - count(layer) == 16 * FRAC["num_heads"]


def test_frac_mixer_init():
  """DESIGN.md section 4: dt ~ 1, alpha spread over [0.2, 0.9] across heads (as closely as a
  start with sigmoid'(alpha logit) >= 0.1 for every head allows: 0.19-0.86), D = 1; the
  modes' rates span [0.03 / context, 4] (warped times up to 4 context), unscaled (c_h = 1);
  gated-norm gain ones, conv bias zeros, projections lecun-normal."""
  d, heads, head_dim, state_dim, context = 64, 8, 16, 8, 512
  layer = build(FRACMixer, d, num_heads=heads, head_dim=head_dim, state_dim=state_dim,
                context=context)
  dt = softplus(P(layer.dt_bias))
  assert np.all((dt >= 0.5 - 1e-6) & (dt <= 2.0 + 1e-6)), dt
  assert abs(np.mean(np.log(dt))) < 0.3 and np.ptp(np.log(dt)) > 0.3, dt  # around 1, spread
  np.testing.assert_allclose(layer.alpha(), 0.05 + 0.95 * np.linspace(0.15, 0.85, heads),
                             atol=1e-5)
  s = 1 / (1 + np.exp(-P(layer.alpha_logit)))
  assert np.all(s * (1 - s) >= 0.1), s * (1 - s)   # no head starts frozen
  np.testing.assert_array_equal(layer.skip[...], np.ones(heads))
  np.testing.assert_array_equal(layer.log_timescale[...], np.zeros(heads))
  np.testing.assert_array_equal(layer.norm_gain[...], np.ones(heads * head_dim))
  np.testing.assert_array_equal(layer.conv_bias[...], np.zeros(heads * head_dim))
  np.testing.assert_array_equal(layer.bc_conv_bias[...], np.zeros(2 * state_dim))
  rates, weights = layer.modes()
  expected_rates, expected_weights = soe_modes_numpy(np.asarray(layer.alpha()), context)
  np.testing.assert_allclose(rates, expected_rates, rtol=1e-5)
  np.testing.assert_allclose(weights, expected_weights, rtol=1e-4)
  np.testing.assert_allclose(rates[:, 1], 0.03 / context, rtol=1e-5)
  np.testing.assert_allclose(rates[:, -1], 4.0, rtol=1e-5)
  for name in ("in_proj", "bc_proj", "dt_proj"):            # one fused [d, 2 d_in + 2N + H]
    stats_match(getattr(layer, name)[...], std=d ** -0.5, name=name)
  stats_match(layer.out_proj[...], std=(heads * head_dim) ** -0.5, name="out_proj")
  conv = np.concatenate([layer.conv_weight[...], layer.bc_conv_weight[...]], 1)
  #                                                         uniform(-1, 1) / sqrt(width)
  stats_match(conv, std=0.5 / math.sqrt(3), bound=0.5, name="conv_weight")


def test_mamba2_init_timescales():
  """mamba2=True: one mode of weight 1, A_h log-spaced over [1/context, 1] across heads."""
  layer = build(FRACMixer, 16, mamba2=True, **dict(FRAC, num_heads=4))
  rates, weights = layer.modes()
  np.testing.assert_allclose(rates[:, 0], np.geomspace(1.0, 1.0 / 64, 4), rtol=1e-5)
  np.testing.assert_array_equal(weights, np.ones((4, 1)))


def test_mamba_ssm_init():
  """mamba2=True, init="mamba_ssm" (mamba_ssm's Mamba2 defaults): A_h ~ U[1, 16] per head,
  stored as log_timescale = log A_h, the mode's rate; dt_h = exp(U[log 1e-3, log 1e-1])
  (floor 1e-4) as dt_bias = softplus^-1(dt_h). Statistics over 512 heads."""
  heads = 512
  layer = build(FRACMixer, 16, mamba2=True, init="mamba_ssm", num_heads=heads, head_dim=1,
                state_dim=4, context=64)
  a = np.exp(P(layer.log_timescale))
  assert np.all((a >= 1.0 - 1e-5) & (a <= 16.0 + 1e-4)), (a.min(), a.max())
  assert abs(a.mean() - 8.5) < 0.6 and abs(a.std() - 15 / math.sqrt(12)) < 0.4, (a.mean(), a.std())
  rates, weights = layer.modes()
  np.testing.assert_allclose(rates[:, 0], a, rtol=1e-5)
  np.testing.assert_array_equal(weights, np.ones((heads, 1)))
  dt = softplus(P(layer.dt_bias))
  log_dt = np.log(dt)
  assert np.all((dt >= 1e-3 * (1 - 1e-3)) & (dt <= 0.1 * (1 + 1e-3))), (dt.min(), dt.max())
  lo, hi = math.log(1e-3), math.log(0.1)                    # log dt uniform on [lo, hi]
  assert abs(log_dt.mean() - (lo + hi) / 2) < 0.25, log_dt.mean()
  assert abs(log_dt.std() - (hi - lo) / math.sqrt(12)) < 0.12, log_dt.std()
  default = build(FRACMixer, 16, mamba2=True, num_heads=4, head_dim=4, state_dim=4, context=64)
  np.testing.assert_allclose(np.exp(P(default.log_timescale)), np.geomspace(1, 1 / 64, 4),
                             rtol=1e-5)


# ----------------------------------------------------------------------------- Block, models

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


def swiglu_numpy(layer, x):
  return (silu(x @ P(layer.w_gate)) * (x @ P(layer.w_up))) @ P(layer.w_down)


def test_language_model_formula_and_init():
  """tokens -> embedding -> pre-norm blocks (attention, SwiGLU) -> RMSNorm -> head."""
  model = build(LanguageModel, d_model=16, num_layers=2, num_heads=2, context=32,
                ffn_options={"d_ff": 24})
  for i, norm in enumerate([model.norm] + [n for b in model.blocks for n in (b.norm1, b.norm2)]):
    randomize(norm.scale, 20 + i)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 11)).astype(np.int32)
  x = P(model.embed)[tokens]
  for block in model.blocks:
    x = x + causal_attention_numpy(block.mixer, rms_norm(x, P(block.norm1.scale)))
    x = x + swiglu_numpy(block.ffn, rms_norm(x, P(block.norm2.scale)))
  expected = rms_norm(x, P(model.norm.scale)) @ P(model.head)
  logits = run(model, tokens)
  assert logits.dtype == jnp.float32
  close(logits, expected)
  # init: embedding normal(0, 1), head normal(0, d^-1/2); the FRAC mixer gets the context
  stats_match(model.embed[...], std=1.0, name="embed")
  stats_match(model.head[...], std=16 ** -0.5, name="head")
  frac = nnx.eval_shape(lambda: LanguageModel(
      d_model=16, num_layers=1, num_heads=2, context=4096, mixer="frac",
      mixer_options={"head_dim": 8, "state_dim": 4}, ffn_options={"d_ff": 8},
      rngs=rngs()))
  mixer = frac.blocks[0].mixer
  assert (mixer.context, mixer.num_heads, mixer.num_modes) == (4096, 2, 16)


def test_pack3d_segmenter_formula_and_init():
  """tokens -> linear patch embedding (+ bias) -> Block(Pack3DAttention, SwiGLU) -> RMSNorm
  -> head -> [B, N, p^3, K]."""
  coords, field_ids = two_fields(seed=1)
  patch, classes, d = (2, 2, 2), 3, 12
  model = build(Pack3DSegmenter, patch=patch, num_classes=classes, d_model=d, depth=1,
                num_heads=2, ffn_options={"d_ff": 16})
  randomize(model.embed_bias, 1, center=0.0)
  for i, norm in enumerate((model.norm, model.blocks[0].norm1, model.blocks[0].norm2)):
    randomize(norm.scale, 2 + i)
  tokens = normal(3, coords.shape[:2] + (8,))
  x = tokens @ P(model.embed) + P(model.embed_bias)
  block = model.blocks[0]
  x = x + pack3d_layer_numpy(block.mixer, rms_norm(x, P(block.norm1.scale)), coords, field_ids,
                             heads=2)
  x = x + swiglu_numpy(block.ffn, rms_norm(x, P(block.norm2.scale)))
  expected = (rms_norm(x, P(model.norm.scale)) @ P(model.head)).reshape(
      coords.shape[:2] + (8, classes))
  got = nnx.jit(lambda m, t: m(t, coords, field_ids))(model, jnp.asarray(tokens, jnp.float32))
  close(got, expected)
  fresh = build(Pack3DSegmenter, patch=(4, 4, 4), num_classes=4, d_model=24, depth=1,
                num_heads=2, ffn_options={"d_ff": 8})
  stats_match(fresh.embed[...], std=64 ** -0.5, name="embed")   # normal / sqrt(p^3 C)
  stats_match(fresh.head[...], std=24 ** -0.5, name="head")     # normal / sqrt(d)
  np.testing.assert_array_equal(fresh.embed_bias[...], np.zeros(24))


# ----------------------------------------------------------------------------- UNet3D

def conv3d_same(x, kernel, bias):
  """Cross-correlation with zero 'SAME' padding: x [B, Z, Y, X, C], kernel [kz, ky, kx, C, O]."""
  kz, ky, kx = kernel.shape[:3]
  pad = [(0, 0)] + [((k - 1) // 2, k // 2) for k in (kz, ky, kx)] + [(0, 0)]
  xp = np.pad(x, pad)
  z, y, w = x.shape[1:4]
  out = np.zeros(x.shape[:4] + (kernel.shape[-1],))
  for a in range(kz):
    for b in range(ky):
      for c in range(kx):
        out += xp[:, a:a + z, b:b + y, c:c + w] @ kernel[a, b, c]
  return out + bias


def up2(x, kernel, bias):
  """flax ConvTranspose, kernel 2, stride 2: each voxel becomes a 2x2x2 block, out[2i + a]
  = x[i] kernel[1 - a] (lax.conv_transpose without kernel transposition)."""
  bsz, z, y, w, _ = x.shape
  out = np.zeros((bsz, 2 * z, 2 * y, 2 * w, kernel.shape[-1]))
  for a in range(2):
    for b in range(2):
      for c in range(2):
        out[:, a::2, b::2, c::2] = x @ kernel[1 - a, 1 - b, 1 - c]
  return out + bias


def conv_block(block, x):
  for conv, norm in zip(block.convs, block.norms):
    x = silu(rms_norm(conv3d_same(x, P(conv.kernel), P(conv.bias)), P(norm.scale)))
  return x


def test_unet3d_formula():
  """models/unet3d.py's docstring: per level two (3^3 conv -> RMSNorm -> SiLU), 2^3 max-pool
  down, transposed conv up, concat [up, skip], two convs, 1^3 conv out."""
  model = build(UNet3D, in_channels=2, num_classes=3, base_channels=2, levels=2)
  for i, (_, p) in enumerate(nnx.iter_graph(model)):
    if isinstance(p, nnx.Param) and p[...].ndim == 1:       # biases and norm scales
      randomize(p, 30 + i, center=0.5)
  image = normal(1, (1, 4, 4, 6, 2))
  skip = conv_block(model.down[0], image)
  b, z, y, w, c = skip.shape
  pooled = skip.reshape(b, z // 2, 2, y // 2, 2, w // 2, 2, c).max(axis=(2, 4, 6))
  deep = conv_block(model.down[1], pooled)
  up = up2(deep, P(model.up[0].kernel), P(model.up[0].bias))
  x = conv_block(model.merge[0], np.concatenate([up, skip], -1))
  expected = conv3d_same(x, P(model.out.kernel), P(model.out.bias))
  out = run(model, image.astype(np.float32))
  assert out.dtype == jnp.float32
  close(out, expected)
  assert [blk.convs[0].kernel.shape[-1] for blk in model.down] == [2, 4]  # base * 2^level
