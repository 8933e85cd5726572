"""What every Mosaic GPU kernel body here shares (FlashFFN, FRAC, Pack3D): the shared-memory
operand tiling the tensor cores want, float32 products and running sums in tensor-core
accumulators, operands written from registers for the tensor cores to read, and the
interpreter/compiler parameters. Each function takes the `plgpu` module
(`dispatch.mosaic_gpu_module()`), so importing this file needs no Mosaic GPU.

Two tensor-core generations, chosen per chip when a kernel is traced (`blackwell`):
- Hopper (compute capability 9): WGMMA. Accumulators live in registers (`plgpu.ACC`, zero
  at the start); `wgmma_wait` says when the issued MMAs (and their operand reads) are done.
- Blackwell (10): tcgen05. Accumulators live in tensor memory (`plgpu.TMEM`, undefined at
  the start: the first MMA into one overwrites it); one thread issues the MMAs, a barrier
  that orders the tensor core says when they are done, and the results are loaded from
  tensor memory into registers. M of every MMA is 64 or 128 (a tile's row count).
The bodies are written once against `accumulators`, `mma`, `mma_wait`, `read`, `products`
and `product_sum`, which issue the chip's instructions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl

from neurips26_jax.pallas_kernels.dispatch import BLACKWELL, compute_capability

_F32 = jnp.float32


def blackwell() -> bool:
  """Whether the kernel being traced is for a Blackwell GPU (compute capability 10.x: tcgen05
  and tensor memory); else Hopper's WGMMA (also what the interpreter runs for no known chip)."""
  capability = compute_capability()
  return capability is not None and capability[0] == BLACKWELL


def smem_transforms(plgpu, dtype, *minors: int):
  """Tiling and swizzle of a kernel's shared-memory operands, whose minor dims hold `minors`
  elements: the largest swizzle that suits them all (an MMA needs A's and B's to match)."""
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


@dataclasses.dataclass(frozen=True)
class _TensorMemory:
  """A Blackwell accumulator: its tensor-memory ref [M, N] float32 and the barrier that the
  completion of MMAs into it arrives on."""

  ref: Any
  done: Any


def accumulators(plgpu, fn, *shapes):
  """fn(*accs) with one float32 accumulator per shape in `shapes`, for `mma`; fn's result."""
  if not blackwell():
    return pl.run_scoped(fn, *(plgpu.ACC(shape, _F32) for shape in shapes))

  def run(done, *refs):
    return fn(*(_TensorMemory(ref, done) for ref in refs))
  return pl.run_scoped(run, plgpu.Barrier(orders_tensor_core=True),
                       *(plgpu.TMEM(shape, _F32) for shape in shapes))


def mma(plgpu, acc, a, b, accumulate=True):
  """Issues acc += a @ b (a [M, K], b [K, N] in shared memory; acc from `accumulators`).
  accumulate=False (a bool or traced bool) overwrites acc instead: pass it for the first MMA
  into an accumulator (Blackwell's tensor memory starts undefined; Hopper's WGMMA
  accumulators start at zero, so there it changes nothing)."""
  if blackwell():
    plgpu.tcgen05_mma(acc.ref, a, b, accumulate=accumulate)
  else:
    plgpu.wgmma(acc, a, b)


def mma_wait(plgpu, acc):
  """Waits for every MMA issued so far: their shared-memory operands may be overwritten and
  `read` sees their sums. `acc` is any live accumulator (Blackwell waits on its barrier)."""
  if blackwell():
    plgpu.tcgen05_commit_arrive(acc.done)
    plgpu.barrier_wait(acc.done)
  else:
    plgpu.wgmma_wait(0)


def read(plgpu, *accs):
  """The float32 values of `accs` (after `mma_wait`; from one `accumulators` call); they may
  be written again afterwards.

  Blackwell: every thread loads its rows from tensor memory and waits for its own loads; the
  next MMA into these columns is issued by one thread, so the loads are ordered before it by
  an arrival on the accumulators' barrier, which orders the tensor core (every thread fences
  with tcgen05's before-thread-sync, then one arrives), and the wait on it (after-thread-sync
  fence). A plain thread barrier would not order tensor-memory accesses."""
  if not blackwell():
    return tuple(acc[...] for acc in accs)
  values = tuple(plgpu.async_load_tmem(acc.ref) for acc in accs)
  plgpu.wait_load_tmem()
  plgpu.barrier_arrive(accs[0].done)
  plgpu.barrier_wait(accs[0].done)
  return values


def products(plgpu, shape, pairs):
  """[a_i @ b_i for (a_i, b_i) in pairs]: float32 [M, N] values, each in its own accumulator;
  returns once the matmuls are done (their operands may be overwritten)."""
  def run(*accs):
    for acc, (a, b) in zip(accs, pairs):
      mma(plgpu, acc, a, b, accumulate=False)
    mma_wait(plgpu, accs[0])
    return read(plgpu, *accs)
  return accumulators(plgpu, run, *(shape for _ in pairs))


def product_sum(plgpu, shape, pairs):
  """sum_i a_i @ b_i over (a_i, b_i) in pairs, in one float32 [M, N] accumulator; returns
  once the matmuls are done."""
  def run(acc):
    for i, (a, b) in enumerate(pairs):
      mma(plgpu, acc, a, b, accumulate=i > 0)
    mma_wait(plgpu, acc)
    (value,) = read(plgpu, acc)
    return value
  return accumulators(plgpu, run, shape)


def store_operands(plgpu, pairs):
  """Writes register values to the shared-memory buffers an MMA reads its A operand from
  (in the buffers' dtype) and fences them for the tensor core's async proxy."""
  for buf, value in pairs:
    buf[...] = value.astype(buf.dtype)
  plgpu.commit_smem()
