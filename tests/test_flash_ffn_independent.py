"""FlashFFN against the independent float64 references of `tests/independent.py`: the fused
mixture as a loop over heads and experts of small MLPs, on every path (reference, XLA chunks,
Mosaic, Triton and Mosaic GPU bodies), forward and gradients (by central differences) and
bf16; and the layer against DESIGN.md section 2 evaluated from its own parameters.

Inputs are random (never zeros), sizes odd, and every bf16 reference is evaluated on the
bf16-rounded inputs (so only the op's own rounding counts). The f32 tolerances are ~40x
above the measured errors, the bf16 ones 2-4x (the numbers are in the comments next to
them); how outputs and gradients are compared: `tests/independent_checks.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.jaxops import flash_ffn as ffn_ops
from neurips26_jax.models import FlashFFN
from neurips26_jax.pallas_kernels import flash_ffn as ffn_kernel
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available
from tests import independent as ind
from tests.independent_checks import as_f64, cast, check, check_directional, params

F32, BF16 = jnp.float32, jnp.bfloat16


# L = 133: two Mosaic token tiles (128 + 5; Mosaic wants multiples of 128), five Triton
# ones (32 each, the last partial); d_e = 24 is a full and a partial 16-wide d_e tile (for
# Mosaic GPU, in one 64-row dK/dU/dV tile; its token tiles are 64 wide, 5 of them).
FFN_SHAPE = dict(b=2, length=133, heads=2, d_h=8, experts=3, d_e=24)
FFN_PATHS = {
    "reference": ffn_ops.mhffn_reference,
    "xla": functools.partial(ffn_ops.mhffn, chunk=32),
    "mosaic": functools.partial(ffn_kernel.mhffn, interpret=True, backend="mosaic",
                                block_q=128, block_inter=16, block_q_dkv=128),
    "triton": functools.partial(ffn_kernel.mhffn, interpret=True, backend="triton",
                                block_q=32, block_inter=16, block_q_dkv=64),
}
if mosaic_gpu_available():  # jax >= 0.11.2; from 0.12 the interpreter raises at a race
  from jax.experimental.pallas import mosaic_gpu as plgpu
  FFN_PATHS["mosaic_gpu"] = functools.partial(
      ffn_kernel.mhffn, interpret=plgpu.InterpretGPUParams(detect_races=True),
      backend="mosaic_gpu", block_q=64, block_inter=16, block_q_dkv=32)
FFN_NAMES = ("q", "r", "k", "u", "v")
# Measured, every path: f32 forward <= 2.1e-7, gradients <= 2.4e-7; bf16 (q, k, u, v in bf16,
# r float32) <= 2.9e-3 (the intermediate a and the output are rounded to bf16).
FFN_TOL = {F32: 1e-5, BF16: 6e-3}
FFN_GRAD_TOL = 1e-5


def _ffn_inputs():
  s = FFN_SHAPE
  rng = np.random.default_rng(8)
  q = rng.standard_normal((s["b"], s["length"], s["heads"], s["d_h"]))
  z = 2 * rng.standard_normal((s["b"], s["length"], s["heads"], s["experts"]))
  r = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  tables = [0.4 * rng.standard_normal((s["heads"], s["experts"], s["d_e"], s["d_h"]))
            for _ in range(3)]
  return (q, r, *tables)


FFN_INPUTS = _ffn_inputs()
_rng = np.random.default_rng(9)
FFN_W = _rng.standard_normal(FFN_INPUTS[0].shape)
FFN_DIRS = tuple(_rng.standard_normal(a.shape) for a in FFN_INPUTS)
FFN_DTYPES = {F32: (F32,) * 5, BF16: (BF16, F32, BF16, BF16, BF16)}


def _ffn_args(dtype):
  return tuple(cast(a, t) for a, t in zip(FFN_INPUTS, FFN_DTYPES[dtype], strict=True))


@functools.lru_cache(maxsize=None)
def ffn_reference_derivatives():
  loss = lambda *args: float(np.sum(FFN_W * ind.mhffn(*args)))
  return tuple(ind.directional_derivative(loss, FFN_INPUTS, i, FFN_DIRS[i]) for i in range(5))


@functools.lru_cache(maxsize=None)
def ffn_run(path, dtype, grads):
  op = FFN_PATHS[path]
  args = _ffn_args(dtype)

  def run(*args):
    if not grads:
      return op(*args), None
    out, vjp = jax.vjp(op, *args)
    return out, vjp(cast(FFN_W, dtype))

  return jax.jit(run)(*args)


@pytest.mark.parametrize("path", params(FFN_PATHS, fast=("reference", "xla", "mosaic", "triton")))
def test_mhffn_forward_and_grads(path):
  out, grads = ffn_run(path, F32, True)
  check(out, ind.mhffn(*FFN_INPUTS), rtol=FFN_TOL[F32], name=f"{path} out")
  check_directional(grads, ffn_reference_derivatives(), FFN_DIRS, rtol=FFN_GRAD_TOL,
                    name=FFN_NAMES)


@pytest.mark.parametrize("path", params(FFN_PATHS, fast=("xla", "mosaic")))
def test_mhffn_bf16_forward(path):
  out, _ = ffn_run(path, BF16, False)
  assert out.dtype == BF16
  expected = ind.mhffn(*(as_f64(a) for a in _ffn_args(BF16)))
  check(out, expected, rtol=FFN_TOL[BF16], name=f"{path} bf16")


@pytest.mark.parametrize("impl,head_norm", [("reference", True), ("reference", False),
                                            ("xla", True), ("pallas", True)])
def test_flashffn_layer_formula(impl, head_norm):
  """models.FlashFFN == DESIGN.md section 2 steps 1-5 evaluated from its own parameters
  (all of them random, the norm gains included)."""
  d, heads, experts, d_e = 24, 3, 3, 16
  layer = nnx.eval_shape(lambda: FlashFFN(d, heads, experts, d_e, head_norm=head_norm,
                                           impl=impl, chunk=5, interpret=True,
                                           rngs=nnx.Rngs(0)))
  state = nnx.state(layer, nnx.Param)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(10)
  scale = {"w_in": 0.3, "w_out": 0.3, "router": 1.0, "norm_gain": 0.5}
  params = {name: jnp.asarray(
      (1.0 + scale[name] * rng.standard_normal(p.shape)) if name == "norm_gain"
      else scale.get(name, 0.3) * rng.standard_normal(p.shape), F32)
      for name, p in params.items()}
  nnx.replace_by_pure_dict(state, params)
  nnx.update(layer, state)
  x = rng.standard_normal((2, 11, d))
  got = nnx.jit(lambda layer, x: layer(x))(layer, cast(x, F32))
  expected = ind.flashffn_layer(x, params, num_heads=heads, head_norm=head_norm)
  check(got, expected, rtol=1e-5, name=f"FlashFFN {impl}")  # measured <= 2.4e-7
