"""The shared kernel checks catch what they claim to: a racy kernel is flagged, whichever
launch of a forward + backward it is."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
