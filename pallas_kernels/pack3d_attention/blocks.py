"""Pack3D attention tile sizes: the dataclass and the per-chip tuned table.

The token tile is always one cube (its slot count rounded up to a power of two >= 16).
Each entry is compiled for its chip by `make compile-check` at 65k tokens (batch 2) and
at the segmentation config's shape, with traced coordinates.
"""

from __future__ import annotations

import dataclasses

from neurips26_jax.pallas_kernels.dispatch import Backend, tuned


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """block_summaries: cube summaries per step of the far stream (an upper bound). Mosaic:
    a multiple of 128 (cubes are the lane axis of the summaries' cube table) unless one
    block holds them all. Mosaic GPU: a multiple of 64 (a block is the summary kernel's
    WGMMA M).
  cubes_per_call: Mosaic only. The neighbour table of the query cubes is prefetched into
    SMEM (1 MiB on v5e/v6e), which [B, C, 27] int32 outgrows (1.7 MiB at 262k tokens,
    batch 4): the kernels run as a loop of calls over blocks of this many query cubes,
    each prefetching its block's rows only.
  block_q_dkv: Triton only. The dK/dV kernel walks each neighbour cube's T query rows in
    blocks of this many (a power of two >= 16; T if larger): its live tiles are [rows, T]
    scores beside the [T, D] dK and dV accumulators.
  num_warps, num_warps_bwd, num_stages: Triton launch parameters (forward and dq;
    dk/dv and summary kernels; all). Mosaic GPU: num_stages steps' tiles in flight in each
    key or query stream (`plgpu.emit_pipeline`).
  """

  block_summaries: int = 128
  cubes_per_call: int = 1024
  block_q_dkv: int = 64
  num_warps: int = 4
  num_warps_bwd: int = 4
  num_stages: int = 2

  @classmethod
  def for_backend(cls, backend: Backend, dtype) -> "BlockSizes":
    return tuned(TUNED, backend, dtype, TUNED[backend, None, "float32"])


# (backend, chip or None for any, dtype) -> BlockSizes; None entries fit the smallest chip.
TUNED = {
    ("mosaic", None, "float32"): BlockSizes(block_summaries=128),
    ("mosaic", None, "bfloat16"): BlockSizes(block_summaries=256),
    # A100 float32: 64-wide summary blocks or dK/dV steps spill 1-9 KB (ptxas falls back
    # to 32 registers); H100/H200 hold them without spills.
    ("triton", None, "float32"): BlockSizes(block_summaries=32, block_q_dkv=16, num_warps=4,
                                            num_warps_bwd=8),
    ("triton", "gpu-h100", "float32"): BlockSizes(block_summaries=64, num_warps=4,
                                                  num_warps_bwd=8),
    ("triton", "gpu-h200", "float32"): BlockSizes(block_summaries=64, num_warps=4,
                                                  num_warps_bwd=8),
    ("triton", None, "bfloat16"): BlockSizes(block_summaries=64, num_warps=4, num_warps_bwd=4),
    # Mosaic GPU: one warpgroup; summaries are the summary kernel's WGMMA M (64 rows).
    ("mosaic_gpu", None, "float32"): BlockSizes(block_summaries=64),
    ("mosaic_gpu", None, "bfloat16"): BlockSizes(block_summaries=64),
}
