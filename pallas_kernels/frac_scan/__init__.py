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
(group, column block of P), a loop over chunks with the states in registers).

`frac_scan` is the one public entry point; it dispatches with
`jax.lax.platform_dependent`: Mosaic on TPU, Triton on GPU, the Mosaic kernel in
interpret mode elsewhere (CPU).
"""

from __future__ import annotations

import functools

from jaxops.frac import check_scan_inputs, scan_vjp, zero_state
from jaxops.frac_chunk import TilePlan
from pallas_kernels.dispatch import Backend, KernelConfig, dispatch
from pallas_kernels.frac_scan import mosaic, triton
from pallas_kernels.frac_scan.blocks import MODE_ALIGN, TUNED, BlockSizes

__all__ = ["BlockSizes", "TUNED", "frac_scan"]

_KERNELS = {"mosaic": mosaic, "triton": triton}


def _run(which: str, plan: TilePlan, backend: Backend, interpret, blocks, *args, **kwargs):
  """`which` ("forward" or "backward") of `backend` (the `dispatch` signature)."""
  return getattr(_KERNELS[backend], which)(plan, blocks, interpret, *args, **kwargs)


def frac_scan(x, dt, b, c, rates, weights, initial_state=None, *, chunk: int = 32,
              interpret=None, backend: Backend | None = None, **block_sizes):
  """Chunked multi-mode scan as a Pallas kernel; arguments and result as
  `jaxops.frac.frac_scan_reference`, differentiable in every float input.

  Args:
    x: [Bt, L, H, P]; dt: [Bt, L, H] > 0; b, c: [Bt, L, H, N]; rates, weights: [H, M];
      initial_state: [Bt, H, M, N, P] or None (zeros). Any L.
    chunk: tokens per chunk (rounded up to a power of two >= 16, at most the padded L).
      Both lowerings share it (it shapes the saved chunk-start states, L / chunk of
      [M, N, P] each); 32 keeps a Triton program's registers from spilling.
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Triton);
      True (or a `pltpu.InterpretParams`) interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic" or "triton"); with `interpret` this runs that
      kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (p_block, num_warps, num_stages);
      defaults from `TUNED` for the chip and dtype.

  Returns:
    (y [Bt, L, H, P] in x.dtype, final state [Bt, H, M, N, P] float32).
  """
  check_scan_inputs(x, dt, b, c, rates, weights, initial_state)
  if not isinstance(chunk, int) or chunk <= 0:
    raise ValueError(f"frac_scan: `chunk` must be a positive int, got {chunk!r}")
  cfg = KernelConfig.make("frac_scan", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes)
  state = zero_state(x, b, rates) if initial_state is None else initial_state
  plan = TilePlan.make(x, b, rates, chunk=chunk, mode_align=MODE_ALIGN, pow2=True)
  forward = lambda *a, **kw: dispatch(functools.partial(_run, "forward", plan, **kw), cfg, *a)
  backward = lambda *a: dispatch(functools.partial(_run, "backward", plan), cfg, *a)
  return scan_vjp(plan, forward, backward)(x, dt, b, c, rates, weights, state)
