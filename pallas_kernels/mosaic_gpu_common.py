"""What every Mosaic GPU kernel body here shares (FlashFFN, FRAC, Pack3D on Hopper): the
shared-memory operand tiling WGMMA wants, float32 products in WGMMA accumulators, operands
written from registers for WGMMA to read, and the interpreter/compiler parameters. Each
function takes the `plgpu` module (`dispatch.mosaic_gpu_module()`), so importing this file
needs no Mosaic GPU."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl


def smem_transforms(plgpu, dtype, *minors: int):
  """Tiling and swizzle of a kernel's shared-memory operands, whose minor dims hold `minors`
  elements: the largest swizzle that suits them all (WGMMA needs A's and B's to match)."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = min(plgpu.find_swizzle(m * bits) for m in minors)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def interpret_params(plgpu, interpret):
  """A kernel's `interpret` argument: None compiles, else interpreter parameters (True: the
  defaults)."""
  if interpret is True:
    return plgpu.InterpretGPUParams()
  return interpret or None


def compiler_params(plgpu):
  """Exact math (no approximate exp/rcp): the kernels are checked against references."""
  return plgpu.CompilerParams(approx_math=False)


def products(plgpu, shape, pairs):
  """[a_i @ b_i for (a_i, b_i) in pairs]: float32 [M, N] values, each in its own
  zero-initialised WGMMA accumulator; reading them waits for the matmuls."""
  def run(*accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b)
    return tuple(acc[...] for acc in accs)
  return pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def store_operands(plgpu, pairs):
  """Writes register values to the shared-memory buffers WGMMA reads its A operand from
  (in the buffers' dtype) and fences them for WGMMA's async proxy."""
  for buf, value in pairs:
    buf[...] = value.astype(buf.dtype)
  plgpu.commit_smem()
