"""RoPE: rotations are orthogonal, logits depend only on offsets, axial parts act per axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import rope
from tests import kernel_checks


def _qk(n=11, h=2, d=12, seed=0):
  kq, kk = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kq, (n, h, d)), jax.random.normal(kk, (n, h, d))


def _logits(q, k):
  return jnp.einsum("ihd,jhd->hij", q, k)


def _coords(n=11, seed=1):
  return jax.random.randint(jax.random.key(seed), (n, 3), 0, 9)


def test_axial_logits_unchanged_when_all_coordinates_shift():
  q, k = _qk()
  c = _coords()
  base = _logits(rope.axial_rope_3d(q, c), rope.axial_rope_3d(k, c))
  shifted = c + jnp.array([5, -3, 17])
  moved = _logits(rope.axial_rope_3d(q, shifted), rope.axial_rope_3d(k, shifted))
  kernel_checks.assert_close(moved, base, rtol=1e-5)
  assert float(jnp.max(jnp.abs(base - _logits(q, k)))) > 1e-2  # the rotation does something


def test_rope_1d_depends_only_on_offsets_and_keeps_norms():
  q, k = _qk()
  pos = jnp.arange(11)
  rq, rk = rope.rope_1d(q, pos), rope.rope_1d(k, pos)
  kernel_checks.assert_close(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-6)
  kernel_checks.assert_close(_logits(rope.rope_1d(q, pos + 40), rope.rope_1d(k, pos + 40)),
                             _logits(rq, rk), rtol=1e-5)


def test_axial_parts_are_1d_ropes_per_axis_with_spacing():
  q, _ = _qk(d=18)
  c = _coords()
  spacing = (1.0, 2.5, 0.5)
  out = rope.axial_rope_3d(q, c, theta=100.0, spacing=spacing)
  for a in range(3):
    part = q[..., 6 * a:6 * (a + 1)]
    expected = rope.rope_1d(part, c[:, a] * spacing[a], theta=100.0)
    kernel_checks.assert_close(out[..., 6 * a:6 * (a + 1)], expected, rtol=1e-6, name=str(a))


def test_inverse_rotation_and_dtype():
  q, _ = _qk()
  c = _coords()
  back = rope.axial_rope_3d_float(rope.axial_rope_3d(q, c), -c)
  kernel_checks.assert_close(back, q, rtol=1e-5)
  assert rope.axial_rope_3d(q.astype(jnp.bfloat16), c).dtype == jnp.bfloat16


@pytest.mark.parametrize("x_shape, coords, match", [
    ((11, 2, 8), np.zeros((11, 3), np.int32), "D divisible by 6"),
    ((11, 2, 12), np.zeros((11, 2), np.int32), "`coords` has shape"),
    ((11, 2, 12), np.zeros((11, 3), np.float32), "`coords` must be integer"),
])
def test_axial_bad_inputs_name_the_argument(x_shape, coords, match):
  with pytest.raises(ValueError, match=match):
    rope.axial_rope_3d(jnp.ones(x_shape), coords)


def test_rope_1d_bad_positions():
  with pytest.raises(ValueError, match="`positions` has shape"):
    rope.rope_1d(jnp.ones((11, 2, 12)), jnp.arange(10))
