"""The shared kernel checks catch what they claim to: a racy kernel is flagged, whichever
launch of a forward + backward it is."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available
from tests import kernel_checks

X = jnp.arange(4 * 8 * 128, dtype=jnp.float32).reshape(32, 128)


def _double(x_ref, o_ref):
  o_ref[...] = 2 * x_ref[...]


@functools.lru_cache(maxsize=None)
def toy(racy: bool, cores: int = 2):
  """Doubles 4 row blocks on a grid marked "parallel". The racy one sends every grid step
  to the same output block: a reduction axis wrongly declared parallel."""
  out_rows = 8 if racy else 32
  return jax.jit(pl.pallas_call(
      _double, grid=(4,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((8, 128), (lambda i: (0, 0)) if racy else (lambda i: (i, 0))),
      out_shape=jax.ShapeDtypeStruct((out_rows, 128), jnp.float32),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=kernel_checks.race_params(cores=cores)))


def test_clean_kernel_passes():
  with kernel_checks.races_checked(kernels=1):
    out = jax.block_until_ready(toy(False)(X))
  assert bool(jnp.all(out == 2 * X))


def test_racy_kernel_is_flagged():
  with pytest.raises(AssertionError, match=r"launch\(es\) \[0\] of 1"):
    with kernel_checks.races_checked(kernels=1):
      jax.block_until_ready(toy(True)(X))


def test_racy_kernel_before_a_clean_one_is_flagged():
  """A forward that races, then a clean backward: reading the interpreter's race flag
  after the last launch (the old check) would pass this."""
  with pytest.raises(AssertionError, match=r"launch\(es\) \[0\] of 2"):
    with kernel_checks.races_checked(kernels=2):
      jax.block_until_ready(toy(True)(X))
      jax.block_until_ready(toy(False)(X))


def test_one_core_cannot_see_the_race():
  """Why the kernel tests use two cores: on one, grid steps run in order and never race."""
  with kernel_checks.races_checked(kernels=1):
    jax.block_until_ready(toy(True, cores=1)(X))


def test_launch_count_is_checked():
  with pytest.raises(AssertionError, match="expected 2 race-checked kernel launches, saw 1"):
    with kernel_checks.races_checked(kernels=2):
      jax.block_until_ready(toy(False, cores=1)(X))


# The Mosaic GPU interpreter (jax >= 0.12) checks its kernels itself: with detect_races it
# raises at the first race. The FlashFFN tests rely on it catching a missing barrier wait.

@functools.lru_cache(maxsize=None)
def mosaic_gpu_toy(wait: bool):
  """Loads a block into shared memory with TMA and doubles it; without `wait` it reads the
  buffer before the copy's barrier says it has landed."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(x_ref, o_ref, x_s, bar):
    plgpu.copy_gmem_to_smem(x_ref, x_s, bar.at[0])
    if wait:
      plgpu.barrier_wait(bar.at[0])
    x_s[...] = 2 * x_s[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_s, o_ref)
    plgpu.wait_smem_to_gmem(0)

  return jax.jit(plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(X.shape, X.dtype),
      scratch_types=[plgpu.SMEM(X.shape, X.dtype), plgpu.Barrier(num_barriers=1)],
      interpret=plgpu.InterpretGPUParams(detect_races=True)))


@pytest.mark.skipif(not mosaic_gpu_available() or jax.__version_info__ < (0, 12),
                    reason="the Mosaic GPU interpreter raises at a race from jax 0.12")
def test_mosaic_gpu_interpreter_flags_a_missing_barrier_wait():
  assert bool(jnp.all(jax.block_until_ready(mosaic_gpu_toy(True)(X)) == 2 * X))
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  try:
    with pytest.raises(Exception, match="RACE DETECTED"):
      jax.block_until_ready(mosaic_gpu_toy(False)(X))
  finally:  # the interpreter must be reset after a kernel raised
    interpret_pallas_call.reset_gpu_interpret_mode_state()
  assert bool(jnp.all(jax.block_until_ready(mosaic_gpu_toy(True)(X)) == 2 * X))
