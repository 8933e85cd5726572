"""Checks every Pallas kernel's tests share: real-hardware lowering, race detection, closeness."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

from neurips26_jax.models.impl import (AMPERE_DEVICE_KIND, BLACKWELL_DEVICE_KIND,  # noqa: F401
                                       HOPPER_DEVICE_KIND)
from neurips26_jax.models.impl import export_mlir as impl_export_mlir

# What each platform's exported module must contain: the Pallas custom call itself,
# so an XLA fallback cannot pass for a kernel.
KERNEL_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}
# The custom call of each kernel body (Mosaic GPU: jax >= 0.12).
BACKEND_CALL = {"mosaic": "tpu_custom_call", "triton": "__gpu$xla.gpu.triton",
                "mosaic_gpu": "mosaic_gpu_v2"}


# The GPU that "cuda" lowerings here are for: an Ampere GPU, so `backend=None` picks the Triton
# body (Hopper ones may get Mosaic GPU).
CUDA_DEVICE_KIND = AMPERE_DEVICE_KIND


def export_mlir(fn, platform: str, *args, device_kind: str = CUDA_DEVICE_KIND) -> str:
  """models.impl.export_mlir, for an Ampere GPU unless `device_kind` says otherwise."""
  return impl_export_mlir(fn, platform, *args, device_kind=device_kind)


@contextlib.contextmanager
def measured_faster(op: str):
  """Inside: `op`'s Mosaic GPU body counts as measured faster than Triton on Hopper and
  Blackwell (`dispatch.MEASURED_FASTER`), so that a test sees where `backend=None` would pick
  it once a chip has: the rules of what the body serves, apart from what has been measured.
  The table is read when a program is traced, so JAX's trace caches are cleared on the way
  in and out (a trace cached on either side would hide the change)."""
  from neurips26_jax.pallas_kernels import dispatch
  saved = dict(dispatch.MEASURED_FASTER)
  jax.clear_caches()
  dispatch.MEASURED_FASTER[op] = (dispatch.HOPPER, dispatch.BLACKWELL)
  try:
    yield
  finally:
    dispatch.MEASURED_FASTER.clear()
    dispatch.MEASURED_FASTER.update(saved)
    jax.clear_caches()


def assert_lowers_to_kernels(fn, platform: str, *args, count: int) -> None:
  """fn lowers for `platform` and its module holds `count` Pallas kernel calls."""
  text = export_mlir(fn, platform, *args)
  found = text.count(KERNEL_CALL[platform])
  assert found == count, f"{platform}: expected {count} kernel calls, found {found}"


def race_params(cores: int = 2, seed: int = 0):
  """TPU-interpreter params that detect races and fill uninitialized memory with NaN.

  `cores` simulated cores (threads) split each kernel's "parallel" grid axes between them
  (points in an order shuffled by `seed`): with one core every grid step runs in sequence,
  so a race between grid steps cannot show.
  """
  from jax.experimental.pallas import tpu as pltpu
  # Record races instead of raising at the first one (jax 0.12's default), so
  # `races_checked` can say which launch raced; jax 0.10 always records.
  record = ({"on_race": "warn"} if "on_race" in
            {f.name for f in dataclasses.fields(pltpu.InterpretParams)} else {})
  return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               num_cores_or_threads=cores, random_seed=seed, **record)


@contextlib.contextmanager
def races_checked(*, kernels: int):
  """Race-checks every kernel interpreted with `race_params()` inside the `with` block.

  The interpreter keeps one race-detection record per kernel launch and drops it when the
  next kernel starts, so reading it after a forward + backward sees the last kernel only.
  This records each launch's record and, on exit, asserts that exactly `kernels` kernels
  ran (so a check cannot pass by running none) and that none of them raced. Run the
  computation to completion (e.g. `jax.block_until_ready`) inside the block.
  """
  records = []
  make = tpu_interpret.RaceDetectionState

  def recording(*args, **kwargs):
    records.append(make(*args, **kwargs))
    return records[-1]

  tpu_interpret.RaceDetectionState = recording
  try:
    yield records
  finally:
    tpu_interpret.RaceDetectionState = make
  assert len(records) == kernels, (
      f"expected {kernels} race-checked kernel launches, saw {len(records)}")
  raced = [i for i, r in enumerate(records) if r.races_found]
  assert not raced, f"kernel launch(es) {raced} of {kernels} (in run order) have a data race"


def assert_close(actual, expected, *, rtol: float, name: str = "") -> None:
  """max|actual - expected| <= rtol * max|expected| (scale-aware for bf16 and sums)."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
  scale = max(float(np.max(np.abs(expected))), 1e-6)
  err = float(np.max(np.abs(actual - expected)))
  assert err <= rtol * scale, f"{name}: max error {err:.3g} > {rtol} * {scale:.3g}"


def relative_error(actual, expected) -> float:
  """max|actual - expected| / max|expected|, in float32."""
  actual = np.asarray(jnp.asarray(actual, jnp.float32))
  expected = np.asarray(jnp.asarray(expected, jnp.float32))
  return float(np.max(np.abs(actual - expected))) / max(float(np.max(np.abs(expected))), 1e-6)


# A bf16 kernel may be this much worse than the XLA path on the same bf16 inputs (plus
# BF16_FLOOR, relative to max|reference|): rounding alone puts both near 1e-3..1e-2, so a
# fixed bf16 tolerance of a few 1e-2 would hide a kernel bug as large as the rounding.
BF16_FACTOR, BF16_FLOOR = 3.0, 1e-4


def assert_bf16_close_to_baseline(actuals, baselines, expected, names) -> None:
  """For each output: error(actual) <= BF16_FACTOR * error(baseline) + BF16_FLOOR, both
  errors measured against the float32 reference `expected` on the same (bf16) inputs."""
  for name, a, base, e in zip(names, actuals, baselines, expected, strict=True):
    assert np.all(np.isfinite(np.asarray(jnp.asarray(a, jnp.float32)))), f"{name}: non-finite"
    err, err_base = relative_error(a, e), relative_error(base, e)
    bound = BF16_FACTOR * err_base + BF16_FLOOR
    assert err <= bound, (f"{name}: bf16 error {err:.3g} > {BF16_FACTOR} x the XLA path's "
                          f"{err_base:.3g} + {BF16_FLOOR}")


def vjp_residuals(fn, *args) -> list:
  """The residuals fn's VJP keeps from its forward (ShapeDtypeStructs: traced only, not run)."""
  return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args))


def sin_loss(op, *args):
  """A non-linear readout of every output of op(*args), so no cotangent is uniform."""
  return sum(jnp.sum(jnp.sin(y.astype(jnp.float32))) for y in jax.tree.leaves(op(*args)))


def assert_bf16_kernel_close(compiled, path: str, args, names) -> None:
  """A kernel body `path` on bf16 `args`: the first output in the input dtype and any other
  (a state) in float32, each gradient in its argument's shape and dtype, and outputs and
  gradients within BF16_FACTOR x the XLA path's error against the float32 reference on the
  same (bf16-rounded) inputs.

  compiled(p) -> jit(args -> (outputs, gradients)) for p = path, "xla" and "reference";
  names: the outputs', then one per argument (messages)."""
  out_ref, grads_ref = compiled("reference")(*(a.astype(jnp.float32) for a in args))
  out, grads = compiled(path)(*args)
  outs, outs_ref = jax.tree.leaves(out), jax.tree.leaves(out_ref)
  assert [o.shape for o in outs] == [o.shape for o in outs_ref]
  assert [o.dtype for o in outs] == [args[0].dtype] + [jnp.float32] * (len(outs) - 1)
  for name, g, a in zip(names[len(outs):], grads, args, strict=True):
    assert g.shape == a.shape and g.dtype == a.dtype, f"{name}: {g.shape} {g.dtype}"
  out_xla, grads_xla = compiled("xla")(*args)
  assert_bf16_close_to_baseline((*outs, *grads), (*jax.tree.leaves(out_xla), *grads_xla),
                                (*outs_ref, *grads_ref), names)


def assert_grads_close(grads, grads_ref, args, names, *, rtol: float) -> None:
  """Each gradient has its input's shape and dtype and is close to the reference one."""
  for name, g, g_ref, a in zip(names, grads, grads_ref, args, strict=True):
    assert g.shape == a.shape and g.dtype == a.dtype, f"d{name}: {g.shape} {g.dtype}"
    assert_close(g, g_ref, rtol=rtol, name=f"d{name}")
