"""How the tests compare the project's fast paths with the float64 references of
`tests/independent.py` (tests/test_<op>_independent.py).

Outputs: max|actual - expected| <= rtol * max|expected| (`check`). Gradients are checked
without autodiff on the reference side: for each differentiable input X and a random
direction dX, the project's <dL/dX, dX> (from its VJP with a random cotangent W,
L = sum(W * out)) must equal the float64 central difference d/de L_ref(X + e dX)
(`check_directional`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def params(names, fast):
  """pytest params over `names`; those not in `fast` are marked slow (the default run
  keeps each file near a minute of CPU time; `-m slow` runs the rest)."""
  return [pytest.param(n, id=n, marks=() if n in fast else pytest.mark.slow) for n in names]


def as_f64(a) -> np.ndarray:
  return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def cast(a, dtype) -> jax.Array:
  return jnp.asarray(np.asarray(a, np.float32)).astype(dtype)


def rounded(a, dtype) -> np.ndarray:
  """What the op sees after casting `a` to `dtype`, back in float64."""
  return as_f64(cast(a, dtype))


def check(actual, expected, *, rtol: float, name: str) -> float:
  """max|actual - expected| <= rtol * max|expected|; returns the relative error."""
  actual, expected = as_f64(actual), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  err = float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), 1e-30)
  assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol}"
  return err


def check_directional(grads, ref_derivs, directions, *, rtol: float, name: str) -> None:
  """<grad_i, dir_i> against the reference's directional derivative, for each input i.

  Scale: |<g, d>| for random Gaussian d is about ||g|| ||d|| / sqrt(size), so the check
  reads |<g - g_ref, d>| <= rtol * ||g|| ||d|| / sqrt(size): a relative L2 gradient error.
  """
  for label, g, ref, d in zip(name, grads, ref_derivs, directions, strict=True):
    g, d = as_f64(g), np.asarray(d, np.float64)
    assert g.shape == d.shape, (label, g.shape, d.shape)
    got = float(np.sum(g * d))
    scale = np.linalg.norm(g) * np.linalg.norm(d) / math.sqrt(d.size) + abs(ref)
    assert abs(got - ref) <= rtol * scale, (
        f"d{label}: <g, d> = {got:.8g}, reference {ref:.8g} (scale {scale:.3g})")
