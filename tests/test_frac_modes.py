"""FRAC modes: the sum-of-exponentials fit of (1+u)^(-alpha) (DESIGN.md section 4 accuracies)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import erfcx

from neurips26_jax.jaxops import frac as ops


def _relative_error(rates, weights, u, target):
  fit = np.asarray(ops.soe_kernel(rates, weights, jnp.asarray(u, jnp.float32)))
  return np.abs(fit / target - 1.0)


@pytest.mark.parametrize("context", [8192, 65536, 262144])
def test_power_law_fit_accuracy(context):
  """Within 0.2% of (1+u)^(-alpha) up to the context and 0.4% up to 4x, alpha in 0.2..0.8."""
  alphas = jnp.array([0.2, 0.5, 0.8])
  rates, weights = ops.soe_modes(alphas, context=context)
  u = np.concatenate([[0.0], np.geomspace(1e-3, 4 * context, 3000)])
  for h, alpha in enumerate(np.asarray(alphas)):
    err = _relative_error(rates[h], weights[h], u, (1 + u) ** -alpha)
    assert err[u <= context].max() < 2e-3, (alpha, err[u <= context].max())
    assert err.max() < 4e-3, (alpha, err.max())


def test_tail_mode_matters():
  """Without the tail mode, small alpha is far off at long range (DESIGN.md: ~25%)."""
  context = 8192
  rates, weights = ops.soe_modes(jnp.array(0.2), context=context)
  u = np.geomspace(1.0, 4 * context, 500)
  assert _relative_error(rates[1:], weights[1:], u, (1 + u) ** -0.2).max() > 0.25
  assert _relative_error(rates, weights, u, (1 + u) ** -0.2).max() < 4e-3
  assert float(rates[0]) < float(rates[1])  # the tail mode comes first


def test_mode_count_from_context():
  assert ops.default_num_modes(8192) == 16 and ops.default_num_modes(262144) == 20
  rates, weights = ops.soe_modes(jnp.full((3, 2), 0.5), context=8192)
  assert rates.shape == weights.shape == (3, 2, 16)
  rates, _ = ops.soe_modes(0.5, num_modes=7, context=8192)
  np.testing.assert_allclose(rates[1], ops.S_LOW / 8192, rtol=1e-5)
  np.testing.assert_allclose(rates[-1], ops.S_HIGH, rtol=1e-5)


def test_differentiable_in_alpha():
  u = jnp.geomspace(1.0, 1000.0, 50)
  fit = lambda a: jnp.sum(jnp.log(ops.soe_kernel(*ops.soe_modes(a, context=1024), u)))
  grad = jax.grad(fit)(0.5)
  numeric = (fit(0.5 + 1e-3) - fit(0.5 - 1e-3)) / 2e-3
  np.testing.assert_allclose(grad, numeric, rtol=1e-2)
  np.testing.assert_allclose(grad, -jnp.sum(jnp.log1p(u)), rtol=1e-2)  # d/da of -a log(1+u)


def test_mittag_leffler_fit():
  """alpha = 1/2 has a closed form: E_{1/2}(-sqrt(u)) = erfcx(sqrt(u)); fit holds for u >= 1."""
  context = 8192
  rates, weights = ops.soe_modes(0.5, context=context, kernel="mittag_leffler")
  u = np.geomspace(1.0, 4 * context, 1000)
  assert _relative_error(rates, weights, u, erfcx(np.sqrt(u))).max() < 4e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(alpha=0.0, context=64), "`alpha`"),
    (dict(alpha=jnp.array([0.5, 1.2]), context=64), "`alpha`"),
    (dict(alpha=1.0, context=64, kernel="mittag_leffler"), "`alpha`"),
    (dict(alpha=0.5, context=64, num_modes=2), "`num_modes`"),
    (dict(alpha=0.5, context=0), "`context`"),
    (dict(alpha=0.5, context=64, kernel="gauss"), "`kernel`"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ops.soe_modes(kwargs.pop("alpha"), **kwargs)
