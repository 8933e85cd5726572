"""FRACMixer: implementations agree, decoding equals the full sequence, the Mamba-2 baseline."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.frac import FRACMixer
from tests import kernel_checks

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
