"""What every Pallas kernel must do, one test body per property over a table of the kernels:
bit-identical reruns, lowering to the expected kernel calls for TPU and GPU, no races and no
uninitialized reads on two simulated cores, and bf16 results as close to the float32
reference as the XLA path's. Each op's own file (tests/test_<op>.py) holds its inputs and
paths and tests what is particular to it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import flash_ffn as flash_ops
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops import pack3d as pack3d_ops
from neurips26_jax.jaxops import packing
from neurips26_jax.pallas_kernels.flash_ffn import mhffn, mhffn_routed
from neurips26_jax.pallas_kernels.frac_scan import frac_scan
from neurips26_jax.pallas_kernels.pack3d_attention import pack3d_attention
from tests import kernel_checks
from tests import test_flash_ffn as flash_tests
from tests import test_flash_ffn_routed as routed_tests
from tests import test_frac_scan as frac_tests
from tests import test_pack3d as pack3d_tests


@dataclasses.dataclass(frozen=True)
class KernelOp:
  """One kernel's entry. Lists of cases are pytest.param(value, id=case, marks=...), the id
  left out where the op has one case."""
  # dtype -> the op's differentiable arguments: small, random (never zeros), odd sizes
  inputs: Callable
  # path -> jit(arguments -> (outputs, gradients)), for "reference", "xla" and each backend
  compiled: Callable
  names: tuple[str, ...]   # the outputs', then one per argument's gradient (messages)
  backends: list           # kernel bodies, run interpreted
  kernels: tuple  # Pallas calls in the forward, and in forward + gradient (an int, or per platform)
  lowerings: list          # () -> (fn, abstract arguments at a benchmark shape)
  races: list              # () -> (kernel under race_params, reference, {name: arg}, launches)


def backend(name, *marks):
  return pytest.param(name, id=name, marks=marks)


# ----------------------------------------------------------------------------- FlashFFN

def _flash_ffn_races():
  """3 heads and 3 token tiles: the cores split the 9-point backward grid 5 + 4, so a head's
  token loop (the dK/dU/dV reduction) would straddle them if that axis were marked parallel."""
  args = flash_tests.make_inputs(jnp.float32, shape=(1, 300, 3, 8, 3, 8))
  op = functools.partial(mhffn, interpret=kernel_checks.race_params(), block_q=128,
                         block_inter=8, block_q_dkv=128)
  return op, flash_ops.mhffn_reference, dict(zip("qrkuv", args)), 2  # fwd, the backward


def _flash_ffn_routed_races():
  """The routed kernels (the layer's): 3 heads of 3 token tiles; each head's first token tile
  stages its tables in VMEM for the others, so the forward's token axis, parallel, would let
  a core start a head past its first tile and read unstaged (NaN) tables."""
  args = routed_tests.make_inputs(jnp.float32, shape=(1, 300, 3, 8, 3, 8))
  op = functools.partial(mhffn_routed, interpret=kernel_checks.race_params(), block_q=128,
                         block_inter=8, block_q_dkv=128)
  with_gain = lambda op: lambda q, w_r, k, u, v, g: op(q, w_r, k, u, v, gain=g)
  return (with_gain(op), with_gain(flash_ops.mhffn_routed_reference),
          dict(zip(("q", "w_r", "k", "u", "v", "gain"), args)), 2)


# ----------------------------------------------------------------------------- FRAC

def _frac_scan_lowering():
  """An odd length and the benchmark's head shape (P = 64, N = 16, M = 16)."""
  spec = lambda *s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d)
  f32 = jnp.float32
  return frac_scan, (spec(1, 333, 4, 64), spec(1, 333, 4, d=f32), spec(1, 333, 4, 16),
                     spec(1, 333, 4, 16), spec(4, 16, d=f32), spec(4, 16, d=f32),
                     spec(1, 4, 16, 16, 64, d=f32))


def _frac_scan_races():
  """3 groups (batch x heads) of 2 chunks, one per grid step: the cores split the groups
  2 + 1, and would split a group's steps if the sequential step axis were marked parallel."""
  args = frac_tests.make_inputs(shape=(1, 20, 3, 8, 8, 2))
  op = functools.partial(frac_scan, interpret=kernel_checks.race_params(), chunk=16,
                         chunks_per_step=1)
  return op, frac_ops.frac_scan_reference, dict(zip(frac_tests.ARGNAMES, args)), 2


# ----------------------------------------------------------------------------- Pack3D

def _far_offset(beta):
  return beta[0] if beta else None


def _pack3d_lowering(far_offset: bool):
  """The benchmark's head shape: a 16^3 field of 4^3 cubes, 2 heads of 48, bfloat16; with a
  far offset the gradient includes d far_offset (no extra kernel)."""
  _, c, f = packing.pack_fields([np.zeros((16, 16, 16, 1))])
  op = lambda q, k, v, *beta: pack3d_attention(q, k, v, c[None], f[None],
                                               far_offset=_far_offset(beta))
  spec = jax.ShapeDtypeStruct((1, 4096, 2, 48), jnp.bfloat16)
  beta = (jax.ShapeDtypeStruct((2,), jnp.float32),) if far_offset else ()
  return op, (spec, spec, spec, *beta)


def _pack3d_races(far_offset: bool):
  """The cores split the 6 query cubes of one field, each with its own far cubes. The
  far-offset kernels run every access of the plain ones plus the offset's operand and the
  summary kernel's d far_offset output."""
  coords, field_ids = pack3d_tests.packed(([(2, 4, 6)],))
  q, k, v = pack3d_tests.make_qkv(jnp.float32, n=48, batch=1, heads=1)
  args = dict(q=q, k=k, v=v) | ({"far_offset": jnp.asarray([-0.7])} if far_offset else {})
  kwargs = dict(block_shape=pack3d_tests.BLOCK, radius_blocks=0)
  op = lambda q, k, v, *beta: pack3d_attention(
      q, k, v, coords, field_ids, far_offset=_far_offset(beta), block_summaries=8,
      interpret=kernel_checks.race_params(), **kwargs)
  ref = lambda q, k, v, *beta: pack3d_ops.pack3d_attention_reference(
      q, k, v, coords, field_ids, far_offset=_far_offset(beta), **kwargs)
  return op, ref, args, 4  # forward, dq, dk/dv, summaries


# Mosaic GPU (jax >= 0.11.2) is slow in its interpreter (~15 s per case on two cores).
MOSAIC_GPU = (flash_tests.needs_mosaic_gpu, pytest.mark.slow)

OPS = {
    "flash_ffn": KernelOp(
        inputs=flash_tests.make_inputs, compiled=flash_tests.compiled,
        names=("o", "dq", "dr", "dk", "du", "dv"),
        backends=[backend("mosaic"), backend("triton"), backend("mosaic_gpu", *MOSAIC_GPU)],
        # forward; TPU: forward, the fused backward; GPU: forward, dq/dr, dK/dU/dV
        kernels=(1, {"tpu": 2, "cuda": 3}),
        lowerings=[pytest.param(lambda: (mhffn, flash_tests.paper_shape()))],
        races=[pytest.param(_flash_ffn_races),
               pytest.param(_flash_ffn_routed_races, id="routed")]),
    "frac_scan": KernelOp(
        inputs=frac_tests.make_inputs, compiled=frac_tests.compiled,
        names=("y", "state", *(f"d{n}" for n in frac_tests.ARGNAMES)),
        backends=[backend("mosaic"), backend("triton"), backend("mosaic_gpu", *MOSAIC_GPU)],
        kernels=(1, 2),  # forward; forward, backward
        lowerings=[pytest.param(_frac_scan_lowering)],
        races=[pytest.param(_frac_scan_races)]),
    "pack3d": KernelOp(
        inputs=pack3d_tests.make_qkv, compiled=pack3d_tests.compiled,
        names=("o", "dq", "dk", "dv"),
        # The Mosaic body's interpreter is the suite's slowest here (36 s for both properties):
        # tests/test_pack3d.py checks it in f32 and its bf16 error against XLA's by default.
        backends=[backend("mosaic", pytest.mark.slow), backend("triton")],
        kernels=(1, 4),  # forward; forward, dq, dk/dv, summaries
        lowerings=[pytest.param(functools.partial(_pack3d_lowering, False)),
                   pytest.param(functools.partial(_pack3d_lowering, True), id="far_offset")],
        races=[pytest.param(functools.partial(_pack3d_races, True), id="far_offset"),
               pytest.param(functools.partial(_pack3d_races, False), id="no_offset",
                            marks=pytest.mark.slow)]),
}


def cases(field: str):
  """(op name, value) params over every entry's `field`, with ids op[-case]."""
  return [pytest.param(name, *p.values, id="-".join(filter(None, (name, p.id))), marks=p.marks)
          for name, op in OPS.items() for p in getattr(op, field)]


# ----------------------------------------------------------------------------- properties

@pytest.mark.parametrize("op, path", cases("backends"))
def test_interpreted_kernel_twice_is_bit_identical(op, path):
  """The same inputs twice give bit-identical outputs and gradients. (On two simulated
  cores grid order varies; there the race check stands for this.)"""
  entry = OPS[op]
  args = entry.inputs(jnp.float32)
  first, second = entry.compiled(path)(*args), entry.compiled(path)(*args)
  chex.assert_trees_all_equal(first, second)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("op, case", cases("lowerings"))
def test_lowers_for_hardware(op, case, platform):
  """Forward and gradient (of every argument) lower to the op's number of Pallas kernel
  calls, so an XLA fallback cannot pass."""
  fn, args = case()
  forward, with_gradient = OPS[op].kernels
  if isinstance(with_gradient, dict):  # the kernel count differs between platforms
    with_gradient = with_gradient[platform]
  kernel_checks.assert_lowers_to_kernels(fn, platform, *args, count=forward)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, fn), argnums=tuple(range(len(args))))
  kernel_checks.assert_lowers_to_kernels(grad, platform, *args, count=with_gradient)


@pytest.mark.parametrize("op, case", cases("races"))
def test_no_races_and_no_uninitialized_reads(op, case):
  """Every kernel of the forward and backward race-checked on two simulated cores, with
  uninitialized memory NaN-filled: the gradients still match the reference."""
  kernel, reference, args, launches = case()
  argnums = tuple(range(len(args)))
  grad = lambda fn: jax.jit(jax.grad(functools.partial(kernel_checks.sin_loss, fn),
                                     argnums=argnums))
  with kernel_checks.races_checked(kernels=launches):
    grads = jax.block_until_ready(grad(kernel)(*args.values()))
  grads_ref = grad(reference)(*args.values())
  for name, g, g_ref in zip(args, grads, grads_ref, strict=True):
    kernel_checks.assert_close(g, g_ref, rtol=1e-5, name=f"d{name}")


@pytest.mark.parametrize("op, path", cases("backends"))
def test_bf16_as_close_to_the_float32_reference_as_xla(op, path):
  """bf16 inputs: outputs and gradients within 3x the XLA path's own error against the
  float32 reference on the same inputs (kernel_checks.assert_bf16_kernel_close)."""
  entry = OPS[op]
  kernel_checks.assert_bf16_kernel_close(entry.compiled, path, entry.inputs(jnp.bfloat16),
                                         entry.names)
