"""RoPE against the independent float64 references of `tests/independent.py`: the frequency
formula written out (1D and axial, float32 and bf16, small and large spaced coordinates),
and the axial logits as rotations by the offset alone.

Inputs are random and every bf16 reference is evaluated on the bf16-rounded inputs (so only
the op's own rounding counts); the tolerances follow from the float32 angle's rounding
(`_rope_rtol`); how outputs are compared: `tests/independent_checks.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import rope as rope_ops
from tests import independent as ind
from tests.independent_checks import as_f64, cast, check, rounded

F32, BF16 = jnp.float32, jnp.bfloat16


ROPE_CASES = {
    # name: (coordinate range, theta, spacing)
    "small_default": (10, 10000.0, (1.0, 1.0, 1.0)),
    "large_spaced": (3000, 500.0, (0.7, 1.3, 2.5)),
}


def _rope_inputs(case, d=18):
  high, theta, spacing = ROPE_CASES[case]
  rng = np.random.default_rng(1)
  x = rng.standard_normal((2, 7, 3, d))
  coords = rng.integers(0, high, size=(2, 7, 3)).astype(np.int32)
  coords[0, 0] = (high - 1, 0, high // 2)
  return x, coords, theta, spacing


def _rope_rtol(dtype, coords, spacing):
  """A float32 angle A = p s theta^(-k/m) is off by ~A 2^-24 (a few roundings of ~2^-24
  relative): an absolute phase error of 4.5e-4 at A = 7500 (measured 7e-5 relative to
  max|x| with coordinates up to 3000 and spacing 2.5; 8e-8 with small coordinates).
  bf16 adds the output's own rounding, unit roundoff 2^-8 = 3.9e-3 relative (measured
  2.2e-3 relative to max|x|; every output element was exactly the bf16 rounding of the
  float32 result)."""
  max_angle = float(np.max(np.abs(coords) * np.asarray(spacing)))
  rtol = max_angle * 2.0 ** -24 + 1e-6
  return rtol + (2.0 ** -8 if dtype == BF16 else 0.0)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_axial_rope_matches_frequency_formula(case, dtype):
  """axial_rope_3d == block-diagonal R(p) built from p_a s_a theta^(-k/m_a), per token."""
  x, coords, theta, spacing = _rope_inputs(case)
  got = rope_ops.axial_rope_3d(cast(x, dtype), jnp.asarray(coords), theta=theta,
                               spacing=spacing)
  assert got.dtype == dtype
  expected = ind.axial_rope_3d(rounded(x, dtype), coords, theta=theta, spacing=spacing)
  check(got, expected, rtol=_rope_rtol(dtype, coords, spacing), name=f"axial {case}")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_rope_1d_matches_frequency_formula(dtype):
  rng = np.random.default_rng(2)
  x = rng.standard_normal((2, 9, 2, 10))
  positions = {"int": rng.integers(0, 2000, size=(2, 9)).astype(np.int32),
               "float": rng.uniform(0.0, 50.0, size=(2, 9)).astype(np.float32)}
  for kind, pos in positions.items():
    got = rope_ops.rope_1d(cast(x, dtype), jnp.asarray(pos), theta=300.0)
    expected = ind.rope_1d(rounded(x, dtype), pos.astype(np.float64), theta=300.0)
    rtol = float(np.max(pos)) * 2.0 ** -24 + 1e-6 + (2.0 ** -8 if dtype == BF16 else 0.0)
    check(got, expected, rtol=rtol, name=f"rope_1d {kind}")


def test_axial_rope_logits_are_relative_rotations():
  """(R(p_i) q_i) . (R(p_j) k_j) through the project == q_i^T R(p_j - p_i) k_j built from the
  offset alone (with spacing and large coordinates)."""
  x, coords, theta, spacing = _rope_inputs("large_spaced")
  q, k = x[0], x[1]  # [7, 3, 18] each
  c = coords[0]
  qr = as_f64(rope_ops.axial_rope_3d(cast(q, F32), jnp.asarray(c), theta=theta,
                                      spacing=spacing))
  kr = as_f64(rope_ops.axial_rope_3d(cast(k, F32), jnp.asarray(c), theta=theta,
                                      spacing=spacing))
  got = np.einsum("ihd,jhd->ijh", qr, kr)
  expected = np.zeros_like(got)
  for i in range(len(c)):
    for j in range(len(c)):
      rel = ind.rope_matrix_3d(c[j] - c[i], q.shape[-1], theta, spacing)
      expected[i, j] = np.einsum("hd,de,he->h", rounded(q, F32)[i], rel, rounded(k, F32)[j])
  check(got, expected, rtol=2 * _rope_rtol(F32, coords, spacing), name="relative logits")
