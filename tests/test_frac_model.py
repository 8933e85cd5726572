"""FRACMixer: implementations agree, decoding equals the full sequence, the Mamba-2 baseline;
the layer against its formula in float64 numpy (tests/layer_formula_checks.py), with and
without selective dt, and its initialisations (FRAC's, Mamba-2's, mamba_ssm's)."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import gammaln

from neurips26_jax.models.frac import FRACMixer
from tests import kernel_checks
from tests.layer_formula_checks import (P, build, close, normal, randomize, rms_norm,
                                         sigmoid, silu, softplus, stats_match)

D_MODEL, L = 16, 21
CONFIG = dict(num_heads=2, head_dim=8, state_dim=8, num_modes=4, context=64, chunk=16)


def _x(batch=2, length=L, seed=3):
  return jax.random.normal(jax.random.key(seed), (batch, length, D_MODEL))


@functools.lru_cache(maxsize=None)
def _outputs(impl: str, mamba2: bool = False):
  config = dict(CONFIG, num_modes=None) if mamba2 else CONFIG
  layer = FRACMixer(D_MODEL, impl=impl, mamba2=mamba2, rngs=nnx.Rngs(0), **config)
  return np.asarray(jax.jit(lambda x: layer(x))(_x()))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_impls_match_reference(impl):
  """impl="pallas" runs the kernel through its default dispatch (interpreted on CPU)."""
  kernel_checks.assert_close(_outputs(impl), _outputs("reference"), rtol=1e-5, name=impl)


@pytest.mark.parametrize("options", [{}, dict(mamba2=True, num_modes=None),
                                     dict(selective_dt=False),
                                     dict(mamba2=True, num_modes=None, init="mamba_ssm")],
                         ids=["frac", "one_mode", "frac_fixed_dt", "mamba_ssm_init"])
def test_decoding_equals_full_sequence(options):
  layer = FRACMixer(D_MODEL, impl="xla", rngs=nnx.Rngs(0), **{**CONFIG, **options})
  cache = layer.init_cache(2)
  step = nnx.jit(lambda layer, x_t, cache: layer.step(x_t, cache))
  ys = []
  for t in range(L):
    y_t, cache = step(layer, _x()[:, t], cache)
    ys.append(y_t)
  full = jax.jit(lambda x: layer(x))(_x())
  kernel_checks.assert_close(jnp.stack(ys, axis=1), full, rtol=1e-5)
  chex.assert_trees_all_equal_shapes_and_dtypes(cache, layer.init_cache(2))


def test_cache_size_with_the_default_mode_count():
  """With the default num_modes, M = ceil(ln(4 context / 0.03)) + 2 grows (only) with the log
  of the context; the cache is the conv window plus M N P numbers per head, and a decoding
  step keeps that size (shapes only: decoding's values are checked above)."""
  x_t = jax.ShapeDtypeStruct((1, D_MODEL), jnp.float32)
  for context, modes in ((1024, 14), (65536, 18)):
    layer = FRACMixer(D_MODEL, **dict(CONFIG, context=context, num_modes=None),
                      rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    rates, weights = jax.eval_shape(layer.modes)
    assert rates.shape == weights.shape == (2, modes)
    cache = layer.init_cache(1)
    assert sum(a.size for a in jax.tree.leaves(cache)) == 3 * (16 + 2 * 8) + 2 * modes * 8 * 8
    _, stepped = nnx.eval_shape(lambda m, x, c: m.step(x, c), layer, x_t, cache)
    chex.assert_trees_all_equal_shapes_and_dtypes(stepped, cache)


def test_mamba2_baseline_is_an_exponential_ssm():
  """mamba2=True: one mode of weight 1, y_t = C_t^T S_t + D x_t with
  S_t = exp(-A_h dt_t) S_{t-1} + dt_t B_t x_t^T, A_h = exp(log_timescale_h)."""
  layer = FRACMixer(D_MODEL, mamba2=True, rngs=nnx.Rngs(0), **dict(CONFIG, num_modes=None))
  rates, weights = layer.modes()
  assert rates.shape == weights.shape == (2, 1)
  np.testing.assert_array_equal(weights, 1.0)
  np.testing.assert_allclose(rates[:, 0], jnp.exp(layer.log_timescale[...]), rtol=1e-6)
  np.testing.assert_allclose(layer.alpha(), 1.0)
  x = _x()
  z, xs, bc, dt_raw = layer._project(x)
  causal = ((0, 0), (3, 0), (0, 0))
  xs, dt, b, c = layer._scan_inputs(*layer._convolve(jnp.pad(xs, causal), jnp.pad(bc, causal)),
                                    dt_raw)
  a = jnp.exp(layer.log_timescale[...])
  state, ys = jnp.zeros((2, 2, 8, 8)), []
  for t in range(L):
    state = (jnp.exp(-a * dt[:, t])[..., None, None] * state
             + jnp.einsum("bh,bhn,bhp->bhnp", dt[:, t], b[:, t], xs[:, t]))
    ys.append(jnp.einsum("bhn,bhnp->bhp", c[:, t], state))
  expected = layer._output(jnp.stack(ys, axis=1), xs, z)
  kernel_checks.assert_close(_outputs("xla", True), expected, rtol=1e-5)


def test_alpha_spread_and_gradients():
  layer = FRACMixer(D_MODEL, impl="reference", rngs=nnx.Rngs(0), **dict(CONFIG, num_heads=4))
  np.testing.assert_allclose(layer.alpha(), 0.05 + 0.95 * np.linspace(0.15, 0.85, 4), atol=1e-5)
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(layer, _x())
  for name in ("alpha_logit", "log_timescale", "dt_bias", "skip", "in_proj", "bc_proj",
               "dt_proj"):
    g = getattr(grads, name)[...]
    assert np.all(np.isfinite(g)) and np.any(g != 0), name


def test_bf16_runs_and_keeps_dtype():
  layer = FRACMixer(D_MODEL, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), **CONFIG)
  y = nnx.jit(lambda m, x: m(x))(layer, _x())
  assert y.dtype == jnp.bfloat16 and y.shape == (2, L, D_MODEL)
  kernel_checks.assert_close(y, _outputs("xla"), rtol=5e-2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="cuda"), "impl"),
    (dict(alpha_min=1.0), "alpha_min"),
    (dict(alpha_init=0.01), "alpha_init"),
    (dict(mamba2=True), "num_modes"),
    (dict(init="mamba_ssm"), "mamba2=True"),
    (dict(init="mamba"), "init"),
    (dict(conv_width=0), "conv_width"),
])
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    FRACMixer(D_MODEL, rngs=nnx.Rngs(0), **{**CONFIG, **kwargs})


def test_bad_input_shapes():
  layer = FRACMixer(D_MODEL, rngs=nnx.Rngs(0), **CONFIG)
  with pytest.raises(ValueError, match="`x`"):
    layer(jnp.ones((2, 5, D_MODEL + 1)))
  with pytest.raises(ValueError, match="`x_t`"):
    layer.step(jnp.ones((2, 1, D_MODEL)), layer.init_cache(2))


# ----------------------------------------------------------------------------- formula and init

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
