"""FRAC scan tile sizes: the dataclass and the per-chip tuned table.

The chunk length and the padded mode count are not block sizes here: they fix the
shapes of the chunk-start states saved for the backward, which both platform branches
must agree on, so they are the op's `chunk` argument and `MODE_ALIGN`. Each entry is
compiled for its chip by `make compile-check`.
"""

from __future__ import annotations

import dataclasses

from neurips26_jax.pallas_kernels.dispatch import Backend, tuned


# Modes are padded to a multiple of this (capped at the largest power of two <= M), so
# any power-of-two mode block up to it divides the padded count.
MODE_ALIGN = 4

# The default chunk on TPU, per chip (None: an unknown TPU). libtpu's static estimate of the
# Mosaic kernels' fwd+bwd (bf16, B=1, L=2048, H=4, P=64, N=16, M=16; `perf_worker
# --program=frac/kernel --blocks='{"chunk": ...}'`), chunk 64 / 128 / 256 / 512 at one chunk
# per grid step: v5e 522K / 405K / 413K cycles / over the scoped VMEM; v6e 480K / 322K /
# 313K / 420K (2026-12-07, the stacked chunk form; benchmarks/README.md, TPU speed); at 8
# chunks per step (the default) v6e 288K at 128 against 302K at 256. v6e keeps 256 (5%
# slower) since a longer chunk saves fewer chunk-start states for the backward (L / chunk
# of [M, N, P] float32 per group: at L = 32k, M = 20, 12 heads of P = 64, 1.9 GiB at 32,
# 0.5 GiB at 128, 0.25 GiB at 256).
TPU_CHUNK = {"tpu-v5e": 128, "tpu-v6e": 256, None: 64}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Launch shapes (Mosaic TPU runs one program per group over all of P and all modes).

  p_block: columns of the head width P per Triton program (Mosaic GPU: always 64).
  m_block: modes per program (at most MODE_ALIGN). Triton: the program's m_block states
    ([N, p_block] float32 each) live in registers across the chunk loop. Mosaic GPU: modes
    per program of the backward's state terms (its other kernels take every mode).
  num_warps: Triton's warps per program (Mosaic GPU: one warpgroup).
  num_stages: Triton's software pipelining (Mosaic GPU: a program per chunk, no pipeline).
  chunks_per_step: Mosaic TPU's chunks per grid step, a loop (a grid step has a cost of its
    own; the largest power of two dividing the chunk count is used, at most this). libtpu's
    static estimate of fwd+bwd (bf16, the `TPU_CHUNK` shape) at 1 / 2 / 4 / 8 / 16 chunks
    per step: v5e (chunk 128) 405K / 383K / 379K / 377K / 378K cycles; v6e (chunk 256)
    313K / - / 302K / 302K / - (2026-12-07, before the 16-bit state products).
  fwd_unroll, bwd_unroll: Mosaic TPU's chunks unrolled in that loop, forward and backward.
    Backward 4 against 2 (8 chunks per step, fwd+bwd at the `TPU_CHUNK` shape): v5e bf16
    288,651 -> 273,515 cycles, float32 502,132 -> 487,012; v6e float32 406,709 -> 397,084
    but bf16 267,640 -> 274,925 (its `TUNED` entry keeps 2). All 8 unrolled ran the float32
    backward at 16k tokens out of v5e's scoped VMEM; at 4 it takes 13.4 MB of 16 MiB (`make
    compile-check`). The forward, all 8 against 4: v5e bf16 62,903 -> 60,742 (the kernel).
  """

  p_block: int = 16
  m_block: int = 4
  num_warps: int = 4
  num_stages: int = 1
  chunks_per_step: int = 8
  fwd_unroll: int = 8
  bwd_unroll: int = 4

  @classmethod
  def for_backend(cls, backend: Backend, dtype) -> "BlockSizes":
    return tuned(TUNED, backend, dtype, cls())


# (backend, chip or None for any, dtype) -> BlockSizes; None entries fit the smallest chip.
# Measured with ptxas at chunk 32, N = 16: 4 modes per program spill ~1 KiB (f32); bf16
# (whose casts keep more values live) spills ~600 B at 2 modes and 8 warps. One mode per
# program spills least but adds more bf16-rounded partial sums (3.7x the XLA path's dc
# error in tests/test_frac_scan.py, against 1.6x at 2 modes). 64-token chunks spill more.
TUNED = {
    ("triton", None, "float32"): BlockSizes(p_block=16, m_block=2, num_warps=4),
    ("triton", None, "bfloat16"): BlockSizes(p_block=16, m_block=2, num_warps=8),
    # float16: the bf16 entries (same widths, so the same registers; compile-checked as bf16)
    ("triton", None, "float16"): BlockSizes(p_block=16, m_block=2, num_warps=8),
    # Mosaic GPU (m_block: modes per program of the backward's state terms, whose shares of
    # dx XLA adds: fewer blocks, fewer [L, P] float32 shares). float32 runs in the
    # interpreter only (dispatch refuses it on a chip); its entry makes the tests run the
    # same blocks.
    ("mosaic_gpu", None, "bfloat16"): BlockSizes(m_block=4),
    ("mosaic_gpu", None, "float16"): BlockSizes(m_block=4),
    ("mosaic_gpu", None, "float32"): BlockSizes(m_block=4),
    # Mosaic TPU: 2 chunks unrolled where 4 is slower (`BlockSizes.bwd_unroll`).
    ("mosaic", "tpu-v6e", "bfloat16"): BlockSizes(bwd_unroll=2),
}
