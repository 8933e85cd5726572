"""Checks every Pallas kernel's tests share: real-hardware lowering, race detection, closeness."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

# What each platform's exported module must contain: the Pallas custom call itself,
# so an XLA fallback cannot pass for a kernel.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


def export_mlir(fn, platform: str, *args) -> str:
  """Lowers jit(fn) for `platform` ("tpu" or "cuda") from CPU; returns the StableHLO text."""
  disabled = ([export.DisabledSafetyCheck.custom_call(KERNEL_CALL["cuda"])]
              if platform == "cuda" else [])
  exported = export.export(jax.jit(fn), platforms=[platform], disabled_checks=disabled)(*args)
  return exported.mlir_module()


def assert_lowers_to_kernels(fn, platform: str, *args, count: int) -> None:
  """fn lowers for `platform` and its module holds `count` Pallas kernel calls."""
  text = export_mlir(fn, platform, *args)
  found = text.count(KERNEL_CALL[platform])
  assert found == count, f"{platform}: expected {count} kernel calls, found {found}"


def race_params():
  """Interpret params that detect races and fill uninitialized memory with NaN."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def assert_no_races() -> None:
  """Call after running a kernel with `race_params()`."""
  assert tpu_interpret.races is not None, "race detection did not run"
  assert not tpu_interpret.races.races_found, "the kernel has a data race"


def assert_close(actual, expected, *, rtol: float, name: str = "") -> None:
  """max|actual - expected| <= rtol * max|expected| (scale-aware for bf16 and sums)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  scale = max(float(np.max(np.abs(expected))), 1e-6)
  err = float(np.max(np.abs(actual - expected)))
  assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


def assert_grads_close(grads, grads_ref, args, names, *, rtol: float) -> None:
  """Each gradient has its input's shape and dtype and is close to the reference one."""
  for name, g, g_ref, a in zip(names, grads, grads_ref, args, strict=True):
    assert g.shape == a.shape and g.dtype == a.dtype, f"d{name}: {g.shape} {g.dtype}"
    assert_close(g, g_ref, rtol=rtol, name=f"d{name}")
