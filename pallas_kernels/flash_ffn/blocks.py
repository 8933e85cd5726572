"""FlashFFN tile sizes: the dataclass and the per-chip tuned table.

Each entry is compiled for its chip by `make compile-check` (benchmarks/aot) at the
paper's 370M shape with 16k tokens and at the configs' shapes: it must fit VMEM / shared
memory, spill at most 1 KiB of registers on GPU and compile in under a minute.
"""

from __future__ import annotations

import dataclasses

from neurips26_jax.pallas_kernels.dispatch import Backend, current_chip, tuned


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the three kernels; upper bounds (small problems use smaller tiles).

  block_q: tokens per tile of the forward and dq kernels (Mosaic: of the forward). Mosaic:
    a multiple of 128 (tokens are the router block's lane axis). Mosaic GPU: a multiple of
    64 (WGMMA's M); 128 on Blackwell (tcgen05's M).
  block_inter: d_e columns per (expert, d_e tile) step of the reduction; the dK/dU/dV
    kernel owns one such tile per program. Mosaic: the tile of the in-kernel loop over a
    head's tables. Mosaic GPU: 16, 32 or a multiple of 64 (at most 128 on Blackwell, where
    the dK/dU/dV kernel's tile is 128 rows).
  block_q_dkv: tokens per step of the dK/dU/dV kernel's token loop (Mosaic: per step of the
    fused backward); same rule as block_q.
  num_warps, num_stages: Triton launch parameters per kernel (ignored by Mosaic).
    Mosaic GPU: num_stages is the depth of its TMA pipelines (buffers per streamed tile).
  compute_wgs: Mosaic GPU on Hopper, 16-bit inputs: 1 runs the one-warpgroup kernels
    (`mosaic_gpu.py`); 2 the warp-specialized ones (`mosaic_gpu_ws.py`: a TMA producer and
    two consumer warpgroups in ping-pong, block_q tokens each in the forward and dq/dr
    kernels; 64 table rows in the dK/dU/dV kernel, block_q_dkv tokens per step; measured on
    no chip yet, so not a default). Ignored by the other backends.

  Sizes a caller passes apply on whatever chip the program is compiled for, and each chip's
  rule holds there: block_q=64 runs on an H100 and is a ValueError on a B200.
  The tuned entries are keyed by dtype name; other 16-bit dtypes (float16) take bfloat16's
  (`dispatch.tuned`).
  """

  block_q: int = 256
  block_inter: int = 256
  block_q_dkv: int = 256
  num_warps: int = 4
  num_warps_dkv: int = 4
  num_stages: int = 2
  compute_wgs: int = 1

  @classmethod
  def for_backend(cls, backend: Backend, dtype) -> "BlockSizes":
    return tuned(TUNED, backend, dtype, TUNED[backend, None, "float32"])


# Triton: register-file sized. The dK/dU/dV kernel carries three [block_inter, d_h] float32
# accumulators, so it gets 8 warps; larger tiles spill at d_h = 128 (measured with ptxas).
_TRITON_F32 = BlockSizes(block_q=32, block_inter=32, block_q_dkv=32, num_warps=4,
                         num_warps_dkv=8, num_stages=2)
_TRITON_BF16 = BlockSizes(block_q=64, block_inter=32, block_q_dkv=64, num_warps=4,
                          num_warps_dkv=8, num_stages=2)

# (backend, chip or None for any, dtype) -> BlockSizes. None entries fit the smallest chip.
TUNED = {
    # Mosaic (TPU): the chips' entries are `make perf-tpu --sweep`'s picks (libtpu's static
    # estimate of each kernel alone at the 370M head shape, 4k tokens; ties within 1% go to
    # the smaller token tile; benchmarks/aot/perf_sweep.json, checked by
    # tests/test_perf_tpu.py). The generic entries fit an unknown TPU's smaller VMEM.
    ("mosaic", None, "float32"): BlockSizes(block_q=256, block_inter=256, block_q_dkv=256),
    ("mosaic", None, "bfloat16"): BlockSizes(block_q=512, block_inter=256, block_q_dkv=256),
    ("mosaic", "tpu-v5e", "float32"): BlockSizes(block_q=1024, block_inter=256,
                                                 block_q_dkv=256),
    ("mosaic", "tpu-v5e", "bfloat16"): BlockSizes(block_q=1024, block_inter=256,
                                                  block_q_dkv=256),
    ("mosaic", "tpu-v6e", "float32"): BlockSizes(block_q=2048, block_inter=256,
                                                 block_q_dkv=512),
    ("mosaic", "tpu-v6e", "bfloat16"): BlockSizes(block_q=2048, block_inter=256,
                                                  block_q_dkv=1024),
    ("triton", None, "float32"): _TRITON_F32,
    ("triton", None, "bfloat16"): _TRITON_BF16,
    # Mosaic GPU (Hopper): one warpgroup per block, float32 accumulators in registers
    # (255 per thread at most; ptxas spills beyond). Float32 also streams transposed copies
    # (TF32 WGMMA wants K-major operands) and needs smaller tiles.
    ("mosaic_gpu", None, "float32"): BlockSizes(block_q=64, block_inter=16, block_q_dkv=16,
                                                num_stages=2),
    ("mosaic_gpu", None, "bfloat16"): BlockSizes(block_q=64, block_inter=32, block_q_dkv=32,
                                                 num_stages=2),
    # Blackwell (tcgen05): accumulators in tensor memory, M = 128 token rows (table rows in
    # the dK/dU/dV kernel); the [128, block_inter] products are loaded into registers.
    ("mosaic_gpu", "gpu-b200", "float32"): BlockSizes(block_q=128, block_inter=16,
                                                      block_q_dkv=16, num_stages=2),
    ("mosaic_gpu", "gpu-b200", "bfloat16"): BlockSizes(block_q=128, block_inter=32,
                                                       block_q_dkv=32, num_stages=2),
}

# VMEM per TensorCore (jax's `tpu_info`): the Mosaic kernels ask for half of it as their
# scoped limit and size their expert groups to fit it (`tiles.mosaic_experts_per_step`). An
# unknown TPU is taken to have the smallest, v4's.
TPU_VMEM = {"tpu-v5e": 128 * 2**20, "tpu-v6e": 128 * 2**20}
_SMALLEST_TPU_VMEM = 16 * 2**20


def mosaic_vmem_limit() -> int:
  """The scoped-VMEM limit (bytes) of the Mosaic kernels on the chip being compiled for."""
  return TPU_VMEM.get(current_chip(), _SMALLEST_TPU_VMEM) // 2
