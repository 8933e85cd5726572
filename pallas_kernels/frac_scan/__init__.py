"""Chunked FRAC scan (multi-mode diagonal SSM) as Pallas kernels, forward and backward.

Math, shapes and the reference: `jaxops.frac`. The per-chunk tile math (M modes folded
into one decay matrix inside a chunk, M states of [N, P] carried across chunks, all
decays from differences of cumulative dt) is `jaxops.frac_chunk`, shared with the
chunked XLA path. Per group g = (batch element, head), chunks c = 0..C-1::

  forward:   S = S0;  for c: starts[c] = S;  y_c, S = chunk_forward(inputs_c, S)
  backward:  dS = dS_final;  for c = C-1..0:  grads_c, dS = chunk_backward(inputs_c,
             starts[c], dy_c, dS)      (recomputes inside the chunk)

State and decays are float32 whatever the input dtype; matmuls of bf16 inputs run in
bf16 with float32 accumulation. Files: `blocks.py` (launch shape and tuned table),
`mosaic.py` (TPU: grid (group, chunk), state in VMEM scratch), `triton.py` (GPU: grid
(group, column block of P), a loop over chunks with the states in registers),
`mosaic_gpu.py` (Hopper GPUs, jax >= 0.11.2: 64-token chunks as WGMMA's M, transposed
states; SSD's order, every kernel a program per chunk, the walk over the chunks an
elementwise scan in XLA between them).

`frac_scan` is the one public entry point; it dispatches with
`jax.lax.platform_dependent`: Mosaic on TPU; Triton on a CUDA GPU (Mosaic GPU, for 16-bit
inputs on Hopper with a chunk of 64, has run on no chip, so it is opt-in:
`dispatch.MEASURED_FASTER`); the Mosaic kernel in interpret mode elsewhere (CPU).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from neurips26_jax.jaxops.frac import check_scan_inputs, scan_vjp, zero_state
from neurips26_jax.jaxops.frac_chunk import TilePlan
from neurips26_jax.pallas_kernels.dispatch import (Backend, KernelConfig, current_chip, dispatch,
                                                   gpu_backend, target_platform)
from neurips26_jax.pallas_kernels.frac_scan import mosaic, mosaic_gpu, triton
from neurips26_jax.pallas_kernels.frac_scan.blocks import MODE_ALIGN, TPU_CHUNK, TUNED, BlockSizes

__all__ = ["BlockSizes", "TUNED", "frac_scan"]

_KERNELS = {"mosaic": mosaic, "triton": triton, "mosaic_gpu": mosaic_gpu}
_BACKENDS = ("mosaic", "triton", "mosaic_gpu")


def _run(which: str, plan: TilePlan, backend: Backend, interpret, blocks, *args, **kwargs):
  """`which` ("forward" or "backward") of `backend` (the `dispatch` signature)."""
  return getattr(_KERNELS[backend], which)(plan, blocks, interpret, *args, **kwargs)


def _check_powers_of_two(block_sizes: dict) -> None:
  """p_block and m_block split the padded P and the padded modes (powers of two) evenly;
  another value would leave columns or modes unprocessed."""
  for name in ("p_block", "m_block"):
    value = block_sizes.get(name)
    if value is not None and (not isinstance(value, int) or value <= 0 or value & (value - 1)):
      raise ValueError(f"frac_scan: `{name}` must be a power of two (it splits the padded "
                       f"{'P' if name == 'p_block' else 'modes'} evenly), got {value!r}")


def _plan(x, b, rates, chunk, backend) -> TilePlan:
  """The tile plan for `chunk`; None: the chip's `TPU_CHUNK` in a program traced for TPU,
  Mosaic GPU's 64 where it will run the scan (forced, or picked on Hopper for 16-bit inputs
  and a shape it serves once measured there: `dispatch.gpu_backend`), else Triton's 32."""
  make = lambda chunk: TilePlan.make(x, b, rates, chunk=chunk, mode_align=MODE_ALIGN, pow2=True)
  if chunk is not None:
    if not isinstance(chunk, int) or chunk <= 0:
      raise ValueError(f"frac_scan: `chunk` must be a positive int, got {chunk!r}")
    return make(chunk)
  if backend in (None, "mosaic") and target_platform() == "tpu":
    return make(TPU_CHUNK.get(current_chip(), TPU_CHUNK[None]))
  on_hopper = backend is None and gpu_backend("frac_scan", _BACKENDS, x.dtype) == "mosaic_gpu"
  if backend == "mosaic_gpu" or on_hopper:
    plan = make(mosaic_gpu.CHUNK)
    if backend == "mosaic_gpu" or not mosaic_gpu.unsupported(plan):
      return plan
  return make(32)


def frac_scan(x: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array, rates: jax.Array,
              weights: jax.Array, initial_state: jax.Array | None = None, *,
              chunk: int | None = None, interpret: Any = None, backend: Backend | None = None,
              **block_sizes: int) -> tuple[jax.Array, jax.Array]:
  """Chunked multi-mode scan as a Pallas kernel; arguments and result as
  `jaxops.frac.frac_scan_reference`, differentiable in every float input.

  Args:
    x: [Bt, L, H, P]; dt: [Bt, L, H] > 0; b, c: [Bt, L, H, N]; rates, weights: [H, M];
      initial_state: [Bt, H, M, N, P] or None (zeros). Any L.
    chunk: tokens per chunk (rounded up to a power of two >= 16, at most the padded L).
      All lowerings share it (it shapes the saved chunk-start states, L / chunk of
      [M, N, P] each). None: in a program traced for TPU, the chip's `blocks.TPU_CHUNK`
      (v5e 128, v6e 256: the fastest the scoped VMEM takes); 64 where the GPU kernel is
      Mosaic GPU (WGMMA's M; its only chunk, or one chunk holding the whole sequence); else
      32 (which keeps a Triton program's registers from spilling). With another chunk (or
      N > 32) backend="mosaic_gpu" raises.
    interpret: None interprets on CPU and compiles on TPU and GPU; True (or the backend's
      interpreter params, `pltpu.InterpretParams` / `plgpu.InterpretGPUParams`) interprets
      everywhere; False never interprets.
    backend: force one lowering ("mosaic", "triton" or "mosaic_gpu", the last on jax >=
      0.11.2 for 16-bit inputs on a chip); with `interpret` this runs that kernel body on
      CPU. None: Mosaic on TPU; Triton on a CUDA GPU (Mosaic GPU only where it was
      measured faster on a chip, `dispatch.gpu_backend`: nowhere yet).
    **block_sizes: overrides of `BlockSizes` fields (p_block, m_block: powers of two;
      num_warps, num_stages; chunks_per_step, fwd_unroll, bwd_unroll on TPU); defaults from
      `TUNED` for the chip and dtype.

  Returns:
    (y [Bt, L, H, P] in x.dtype, final state [Bt, H, M, N, P] float32).
  """
  check_scan_inputs(x, dt, b, c, rates, weights, initial_state)
  _check_powers_of_two(block_sizes)
  plan = _plan(x, b, rates, chunk, backend)
  reason = mosaic_gpu.unsupported(plan)
  if backend == "mosaic_gpu" and reason:
    raise ValueError(f"frac_scan: backend='mosaic_gpu' {reason} (`b` has shape {b.shape})")
  backends = _BACKENDS[:2] if reason else _BACKENDS
  cfg = KernelConfig.make("frac_scan", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes, backends=backends)
  state = zero_state(x, b, rates) if initial_state is None else initial_state
  forward = lambda *a, **kw: dispatch(functools.partial(_run, "forward", plan, **kw), cfg, *a)
  backward = lambda *a: dispatch(functools.partial(_run, "backward", plan), cfg, *a)
  return scan_vjp(plan, forward, backward)(x, dt, b, c, rates, weights, state)
