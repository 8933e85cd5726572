"""FRAC against the independent float64 references of `tests/independent.py`: the modes
against the power law they approximate (the DESIGN.md formula, numeric integrals), the scan
on every path against a per-mode recurrence (gradients by central differences), decoding
step by step, and the scan's memory against the exact power-law convolution.

Inputs are random (never zeros), sizes odd, and every bf16 reference is evaluated on the
bf16-rounded inputs (so only the op's own rounding counts). The f32 tolerances are ~40x
above the measured errors, the bf16 ones 2-4x (the numbers are in the comments next to
them); how outputs and gradients are compared: `tests/independent_checks.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate

from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.pallas_kernels import frac_scan as frac_kernel
from tests import independent as ind
from tests.independent_checks import as_f64, cast, check, check_directional, params

F32, BF16 = jnp.float32, jnp.bfloat16

ALPHAS = np.array([0.2, 0.35, 0.5, 0.65, 0.8])


@pytest.mark.parametrize("context,num_modes", [(8192, None), (262144, None), (1000, 7)])
def test_soe_modes_match_design_formula(context, num_modes):
  """Rates and weights are the DESIGN.md formula (tail first, then the log grid)."""
  alphas = np.array([0.2, 0.45, 0.8, 1.0])
  rates, weights = frac_ops.soe_modes(jnp.asarray(alphas, F32), num_modes=num_modes,
                                      context=context)
  m = num_modes or ind.default_num_modes(context)
  assert rates.shape == weights.shape == (len(alphas), m)
  for h, alpha in enumerate(alphas):
    ref_rates, ref_weights = ind.soe_modes(alpha, m, context)
    np.testing.assert_allclose(as_f64(rates[h]), ref_rates, rtol=2e-5, err_msg=f"{alpha}")
    np.testing.assert_allclose(as_f64(weights[h]), ref_weights, rtol=2e-5, err_msg=f"{alpha}")


def _fit_error(rates, weights, alpha, u):
  return np.abs(ind.sum_of_exponentials(rates, weights, u) / (1 + u) ** -alpha - 1)


@pytest.mark.parametrize("context", [8192, 262144])
def test_soe_modes_approximate_the_power_law(context):
  """Within 0.2% of (1+u)^(-alpha) for u <= T and 0.4% for u <= 4T, alpha in [0.2, 0.8]:
  both the formula written here and the project's modes (evaluated in float64)."""
  u = np.concatenate([[0.0], np.geomspace(1e-3, 4 * context, 4000)])
  rates, weights = frac_ops.soe_modes(jnp.asarray(ALPHAS, F32), context=context)
  m = ind.default_num_modes(context)
  for h, alpha in enumerate(ALPHAS):
    for name, (r, w) in {"formula": ind.soe_modes(alpha, m, context),
                         "project": (as_f64(rates[h]), as_f64(weights[h]))}.items():
      err = _fit_error(r, w, alpha, u)
      assert err[u <= context].max() < 2e-3, (name, alpha, err[u <= context].max())
      assert err.max() < 4e-3, (name, alpha, err.max())


def test_soe_tail_mode_is_needed():
  """Without the tail mode small alpha is far off (DESIGN.md says ~25%; the formula gives
  49% at u = T and 64% at 4T for alpha = 0.2); with it, < 0.4%."""
  context = 8192
  u = np.geomspace(1.0, 4 * context, 500)
  rates, weights = ind.soe_modes(0.2, ind.default_num_modes(context), context)
  assert _fit_error(rates[1:], weights[1:], 0.2, u).max() > 0.25
  assert _fit_error(rates, weights, 0.2, u).max() < 4e-3


def test_soe_modes_as_quadrature_of_the_integral():
  """Numeric integrals: (1+u)^(-a) = int_0^inf rho(s) e^(-s u) ds with
  rho(s) = s^(a-1) e^(-s) / Gamma(a); the tail mode stands for int_0^b (weight = mass,
  rate = mean rate, up to O(b)); the grid modes are a quadrature of int_b^inf."""
  context = 4096
  m = ind.default_num_modes(context)
  for alpha in (0.2, 0.5, 0.8):
    # rho without its s^(a-1) factor: quad's weight="alg" integrates that singularity exactly.
    smooth = lambda s, u=0.0, a=alpha: math.exp(-s * (1 + u)) / math.gamma(a)
    singular = dict(weight="alg", wvar=(alpha - 1, 0))
    rates, weights = ind.soe_modes(alpha, m, context)
    h = math.log(ind.S_MAX * context / ind.S_MIN_TIMES_CONTEXT) / (m - 2)
    assert h <= 1.0
    b = ind.S_MIN_TIMES_CONTEXT / context * math.exp(-h / 2)
    mass = integrate.quad(smooth, 0, b, **singular)[0]
    mean_rate = integrate.quad(lambda s: s * smooth(s), 0, b, **singular)[0] / mass
    np.testing.assert_allclose(weights[0], mass, rtol=2 * b)
    np.testing.assert_allclose(rates[0], mean_rate, rtol=2 * b)
    for u in (0.0, 3.0, 100.0, context, 4.0 * context):
      whole = (integrate.quad(smooth, 0, 1, args=(u,), **singular)[0]
               + integrate.quad(lambda s: s ** (alpha - 1) * smooth(s, u), 1, np.inf)[0])
      np.testing.assert_allclose(whole, (1 + u) ** -alpha, rtol=1e-7)
      # s = e^y makes the log-spaced grid a trapezoid rule in y over [ln b, inf)
      upper = integrate.quad(lambda y: math.exp(alpha * y) * smooth(math.exp(y), u),
                             math.log(b), math.log(60.0), limit=400)[0]
      grid = ind.sum_of_exponentials(rates[1:], weights[1:], u)
      assert abs(grid / upper - 1) < 4e-3, (alpha, u, grid, upper)


FRAC_SHAPE = dict(bt=2, length=37, heads=2, p=5, n=3, m=4)
FRAC_CHUNK = 8  # 37 = 4 chunks + 5
FRAC_PATHS = {
    "reference": frac_ops.frac_scan_reference,
    "xla": functools.partial(frac_ops.frac_scan, chunk=FRAC_CHUNK),
    "mosaic": functools.partial(frac_kernel.frac_scan, interpret=True, backend="mosaic",
                                chunk=FRAC_CHUNK),
    "triton": functools.partial(frac_kernel.frac_scan, interpret=True, backend="triton",
                                chunk=FRAC_CHUNK),
}
FRAC_NAMES = ("x", "dt", "b", "c", "rates", "weights", "initial_state")
# Measured, every path: f32 forward <= 2.2e-7, gradients <= 2.6e-7; bf16 (x, b, c in bf16,
# the rest float32) y <= 1.6e-3 (mostly y's own rounding, unit roundoff 2^-8), state 2e-7.
FRAC_TOL = {F32: 1e-5, BF16: 5e-3}
FRAC_GRAD_TOL = 1e-5


def _frac_inputs():
  s = FRAC_SHAPE
  rng = np.random.default_rng(5)
  x = rng.standard_normal((s["bt"], s["length"], s["heads"], s["p"]))
  dt = np.log1p(np.exp(rng.standard_normal((s["bt"], s["length"], s["heads"]))))  # softplus
  b = 0.5 * rng.standard_normal((s["bt"], s["length"], s["heads"], s["n"]))
  c = 0.5 * rng.standard_normal((s["bt"], s["length"], s["heads"], s["n"]))
  rates = np.exp(rng.uniform(-5.0, 1.8, size=(s["heads"], s["m"])))  # 0.007 .. 6
  weights = rng.uniform(0.1, 1.0, size=(s["heads"], s["m"]))
  state = rng.standard_normal((s["bt"], s["heads"], s["m"], s["n"], s["p"]))
  return x, dt, b, c, rates, weights, state


FRAC_INPUTS = _frac_inputs()
_rng = np.random.default_rng(6)
FRAC_W = (_rng.standard_normal(FRAC_INPUTS[0].shape), _rng.standard_normal(FRAC_INPUTS[6].shape))
FRAC_DIRS = tuple(_rng.standard_normal(a.shape) for a in FRAC_INPUTS)
FRAC_DTYPES = {F32: (F32,) * 7, BF16: (BF16, F32, BF16, BF16, F32, F32, F32)}


def _frac_args(dtype):
  return tuple(cast(a, t) for a, t in zip(FRAC_INPUTS, FRAC_DTYPES[dtype], strict=True))


@functools.lru_cache(maxsize=None)
def frac_reference(dtype, with_state=True):
  args = [as_f64(a) for a in _frac_args(dtype)]
  return ind.frac_scan(*args[:6], args[6] if with_state else None)


@functools.lru_cache(maxsize=None)
def frac_reference_derivatives():
  def loss(*args):
    y, state = ind.frac_scan(*args)
    return float(np.sum(FRAC_W[0] * y) + np.sum(FRAC_W[1] * state))
  return tuple(ind.directional_derivative(loss, FRAC_INPUTS, i, FRAC_DIRS[i])
               for i in range(7))


@functools.lru_cache(maxsize=None)
def frac_run(path, dtype, grads):
  op = FRAC_PATHS[path]
  args = _frac_args(dtype)
  cotangent = (cast(FRAC_W[0], FRAC_DTYPES[dtype][0]), cast(FRAC_W[1], F32))

  def run(*args):
    if not grads:
      return op(*args), None
    out, vjp = jax.vjp(op, *args)
    return out, vjp(cotangent)

  return jax.jit(run)(*args)


@pytest.mark.parametrize("path", params(FRAC_PATHS, fast=("xla", "mosaic", "triton")))
def test_frac_scan_forward_and_grads(path):
  """f32: y and the final state against the per-mode recurrence; gradients of all seven
  inputs against float64 central differences of it."""
  (y, state), grads = frac_run(path, F32, True)
  y_ref, state_ref = frac_reference(F32)
  check(y, y_ref, rtol=FRAC_TOL[F32], name=f"{path} y")
  check(state, state_ref, rtol=FRAC_TOL[F32], name=f"{path} state")
  check_directional(grads, frac_reference_derivatives(), FRAC_DIRS, rtol=FRAC_GRAD_TOL,
                    name=FRAC_NAMES)


@pytest.mark.parametrize("path", params(FRAC_PATHS, fast=("xla",)))
def test_frac_scan_bf16_forward(path):
  (y, state), _ = frac_run(path, BF16, False)
  assert y.dtype == BF16 and state.dtype == F32
  y_ref, state_ref = frac_reference(BF16)
  check(y, y_ref, rtol=FRAC_TOL[BF16], name=f"{path} y bf16")
  check(state, state_ref, rtol=FRAC_TOL[BF16], name=f"{path} state bf16")


def test_frac_scan_zero_initial_state_and_step():
  """initial_state=None (XLA path), and frac_step token by token from a given state."""
  args = _frac_args(F32)
  y, state = jax.jit(FRAC_PATHS["xla"])(*args[:6])
  y_ref, state_ref = frac_reference(F32, with_state=False)
  check(y, y_ref, rtol=FRAC_TOL[F32], name="y from zeros")
  check(state, state_ref, rtol=FRAC_TOL[F32], name="state from zeros")
  step = jax.jit(frac_ops.frac_step)
  x, dt, b, c, rates, weights, state = args
  ys = []
  for t in range(x.shape[1]):
    y_t, state = step(state, x[:, t], dt[:, t], b[:, t], c[:, t], rates, weights)
    ys.append(y_t)
  y_ref, state_ref = frac_reference(F32)
  check(jnp.stack(ys, axis=1), y_ref, rtol=FRAC_TOL[F32], name="frac_step y")
  check(state, state_ref, rtol=FRAC_TOL[F32], name="frac_step state")


def test_frac_memory_is_the_power_law():
  """With the project's modes for alpha_h, the scan's output is the convolution with the
  exact power-law kernel (1 + (T_t - T_tau))^(-alpha_h) to within the fit's 0.4%
  (positive x, B, C, so no cancellation; warped time stays below 4 * context)."""
  rng = np.random.default_rng(7)
  bt, length, heads, p, n = 1, 40, 3, 2, 2
  alphas = np.array([0.25, 0.5, 0.9])
  context = 32
  x = rng.uniform(0.5, 1.5, (bt, length, heads, p))
  dt = rng.uniform(0.3, 2.5, (bt, length, heads))
  b = rng.uniform(0.5, 1.5, (bt, length, heads, n))
  c = rng.uniform(0.5, 1.5, (bt, length, heads, n))
  assert np.sum(dt, axis=1).max() < 4 * context
  rates, weights = frac_ops.soe_modes(jnp.asarray(alphas, F32), context=context)
  y, _ = jax.jit(FRAC_PATHS["xla"])(*(cast(a, F32) for a in (x, dt, b, c)), rates, weights)
  power_law = [lambda u, a=a: (1.0 + u) ** -a for a in alphas]
  expected = ind.memory_convolution(x, dt, b, c, power_law)
  rel = np.abs(as_f64(y) / expected - 1)
  assert rel.max() < 4e-3, rel.max()
  # ... and the recurrence written here, with the same modes, is that convolution exactly.
  y_loop, _ = ind.frac_scan(x, dt, b, c, as_f64(rates), as_f64(weights))
  soe = [lambda u, h=h: ind.sum_of_exponentials(as_f64(rates[h]), as_f64(weights[h]), u)
         for h in range(heads)]
  np.testing.assert_allclose(y_loop, ind.memory_convolution(x, dt, b, c, soe), rtol=1e-10)
