"""Pack3D attention as Pallas kernels, forward and backward.

Math and shapes: `jaxops.pack3d` (the reference this kernel is tested against). Tokens
are scattered into the cube-major layout of `jaxops.pack3d_layout.cube_layout` (a cube is a
contiguous slab of T slots, empty slots masked; each slot one [H * D] row, the heads side by
side on the lanes: no head-width padding in HBM), the summaries kbar, vbar are
precomputed in XLA (`cube_summaries`), and for each (batch, head, query cube) the kernel
runs ONE online softmax over two key streams: its <= (2r+1)^3 neighbour cubes, then the
cube summaries, whose far-or-not bias it derives from the cubes' keys (plus the head's
far offset, if given). On TPU one program serves all heads of a query cube.
Backward FlashAttention-2 style: dq over query cubes; dk/dv over key cubes, visiting the
query cubes that have them as neighbours (the relation is symmetric); summary gradients
over summary blocks, reaching the tokens through the (autodiff) VJP of the cube mean; the
far offset's gradient as per-summary sums of the far scores' gradient from the summary
kernel, summed here over batch entries and summaries.

Files: `blocks.py` (tile sizes and the tuned table), `tiles.py` (tile math, far biases,
tile plan, the operand layout), `mosaic.py` (TPU: scalar-prefetched neighbour table,
looped over blocks of query cubes to fit SMEM), `triton.py` (GPU: fori_loops over
neighbours and summaries, head-major operands), `mosaic_gpu.py` (Hopper GPUs, jax >=
0.11.2: TMA and WGMMA, one warpgroup per cube of 64 slots).

`pack3d_attention` is the one public entry point; it dispatches with
`pallas_kernels.dispatch` (Mosaic on TPU; on a CUDA GPU Mosaic GPU for Hopper with 16-bit
inputs and cubes of 33 to 64 tokens, Triton otherwise; interpret mode on CPU).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxops.pack3d import MASK, check_pack3d_inputs, cube_summaries
from jaxops.pack3d_layout import cube_layout, poison_overflow
from jaxops.tiling import next_pow2
from pallas_kernels.dispatch import Backend, KernelConfig, dispatch
from pallas_kernels.pack3d_attention import mosaic, mosaic_gpu, triton
from pallas_kernels.pack3d_attention.blocks import TUNED, BlockSizes
from pallas_kernels.pack3d_attention.tiles import Tables, TilePlan

__all__ = ["BlockSizes", "TUNED", "pack3d_attention"]

_F32 = jnp.float32
_KERNELS = {"mosaic": mosaic, "triton": triton, "mosaic_gpu": mosaic_gpu}


def _plan(backend: Backend, interpret, blocks: BlockSizes, q, tables: Tables, offset, options):
  return TilePlan.make(backend, blocks, q, tables, compiled=not interpret,
                       far_offset=offset is not None, **options)


def _forward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar, offset,
             tables: Tables, *, options):
  plan = _plan(backend, interpret, blocks, q, tables, offset, options)
  kbar, vbar, tables = plan.pad_summaries(kbar, vbar, tables)
  return _KERNELS[backend].forward(plan, blocks, interpret, q, k, v, kbar, vbar, offset, tables)


def _backward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar, offset,
              tables: Tables, o, lse, do, *, options):
  plan = _plan(backend, interpret, blocks, q, tables, offset, options)
  # delta = per-head rowsum(do * o) [B, C, H, T], the head sums as a matmul against the
  # lanes' head indicator (splitting the lanes into [H, D] would pad D on TPU)
  lanes = jnp.arange(plan.heads * plan.head_dim) // plan.head_dim
  heads_of_lanes = (lanes[:, None] == jnp.arange(plan.heads)[None]).astype(_F32)
  product = (do.astype(_F32) * o.astype(_F32)).reshape(plan.batch, plan.cubes, plan.t, -1)
  delta = jnp.einsum("bctx,xh->bcht", product, heads_of_lanes,
                     precision=jax.lax.Precision.HIGHEST)
  kbar_p, vbar_p, tables = plan.pad_summaries(kbar, vbar, tables)
  grads = _KERNELS[backend].backward(plan, blocks, interpret, q, k, v, kbar_p, vbar_p, offset,
                                     tables, do.astype(q.dtype), lse, delta)
  dkbar, dvbar = (g[:, :plan.cubes] for g in grads[3:5])
  # [B, H, Cs] per-summary parts (padded summaries are never far: 0) -> [H, 1, 1]
  d_offset = None if offset is None else jnp.sum(grads[5], axis=(0, 2))[:, None, None]
  return *grads[:3], dkbar, dvbar, d_offset


def _to_slots(layout, x):
  """[B, N, H, D] -> cube slots with the heads on the lanes [B, C * T, H * D], empty slots
  zero: on TPU an [N, H, D] array pads both minor dims (D = 24 to 128 lanes), an
  [N, H * D] one only H * D."""
  batch, n, heads, d = x.shape
  return layout.to_cubes(x.reshape(batch, n, heads * d)).reshape(batch, -1, heads * d)


def _from_slots(layout, o, heads: int):
  """Inverse of `_to_slots`: [B, C * T, H * D] -> [B, N, H, D]."""
  rows = layout.from_cubes(o.reshape(o.shape[0], layout.num_cubes, layout.slots_per_cube, -1))
  return rows.reshape(*rows.shape[:2], heads, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attend(q, k, v, kbar, vbar, offset, tables, cfg: KernelConfig, options):
  """offset: None, or beta [H, 1, 1] float32 (then differentiable too)."""
  return _attend_fwd(q, k, v, kbar, vbar, offset, tables, cfg, options)[0]


def _attend_fwd(q, k, v, kbar, vbar, offset, tables, cfg, options):
  fwd = functools.partial(_forward, options=dict(options))
  o, lse = dispatch(fwd, cfg, q, k, v, kbar, vbar, offset, tables)
  return o, (q, k, v, kbar, vbar, offset, tables, o, lse)


def _attend_bwd(cfg, options, residuals, do):
  grads = dispatch(functools.partial(_backward, options=dict(options)), cfg, *residuals, do)
  return (*grads, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def pack3d_attention(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4),
                     radius_blocks: int = 1, block_bias: bool = True, summary_rope=None,
                     far_offset=None, max_cubes: int | None = None, interpret=None,
                     backend: Backend | None = None, **block_sizes):
  """Pack3D attention as Pallas kernels, differentiable in q, k, v (and far_offset).

  Args:
    q, k, v: [B, N, H, D] (q, k already rotated), float32 or bfloat16.
    coords: int [B, N, 3] (z, y, x) in each token's field; field_ids: int [B, N].
    block_shape, radius_blocks, block_bias, summary_rope, max_cubes: as in
      `jaxops.pack3d.pack3d_attention` (the gated merge is an XLA-path option only).
      With traced coords, an entry needing more than max_cubes cubes gets NaN outputs
      (`jaxops.pack3d_layout.layout_status` says which and why).
    far_offset: None, or beta [H] (float) added to every far-summary logit of its head;
      None leaves the kernels exactly as without it (no offset operand, no gradient output).
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Mosaic GPU on
      Hopper for 16-bit inputs and cubes of 33 to 64 tokens, Triton otherwise); True (or the
      backend's interpreter params, `pltpu.InterpretParams` / `plgpu.InterpretGPUParams`)
      interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic", "triton" or "mosaic_gpu", the last on jax >=
      0.11.2 and for cubes of 33 to 64 tokens only); with `interpret` this runs the other
      platform's kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (block_summaries, cubes_per_call,
      num_warps, num_warps_bwd, num_stages); defaults from `TUNED` for chip and dtype.

  Returns:
    o [B, N, H, D] in q.dtype; matmuls in the input dtype, softmax in float32.
  """
  check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks,
                      far_offset=far_offset)
  slots = next_pow2(math.prod(block_shape))
  if backend == "mosaic_gpu" and not mosaic_gpu.supports(slots):
    raise ValueError(f"pack3d_attention: backend='mosaic_gpu' needs `block_shape` of 33 to "
                     f"{mosaic_gpu.SLOTS} tokens (one WGMMA tile of query rows per cube), got "
                     f"{tuple(block_shape)}: use backend='triton' or None")
  backends = ("mosaic", "triton") + (("mosaic_gpu",) if mosaic_gpu.supports(slots) else ())
  cfg = KernelConfig.make("pack3d_attention", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes, backends=backends)
  layout = cube_layout(coords, field_ids, block_shape=block_shape, radius_blocks=radius_blocks,
                       max_cubes=max_cubes, slots_per_cube=slots)
  batch, n, heads, d = q.shape
  cubes, t = layout.num_cubes, layout.slots_per_cube
  q_s, k_s, v_s = (_to_slots(layout, x) for x in (q, k, v))      # [B, C * T, H * D]
  if summary_rope is None:  # cube means straight from the slots
    inv_n = 1.0 / jnp.maximum(layout.count, 1.0)[:, :, None]
    mean = lambda x: jnp.sum(x.reshape(batch, cubes, t, heads * d).astype(_F32), 2) * inv_n
    kbar, vbar = mean(k_s), mean(v_s)                             # [B, C, H * D]
  else:
    kbar, vbar = (s.reshape(batch, cubes, heads * d) for s in cube_summaries(
        layout, layout.to_cubes(k), layout.to_cubes(v), coords, summary_rope))
  rows = layout.cube_rows()
  tables = Tables(key_bias=jnp.where(layout.key_valid(), 0.0, MASK)[:, :, None, :],
                  cube_rows=rows, cube_cols=jnp.swapaxes(rows, 1, 2),
                  neighbours=layout.neighbours, num_neighbours=layout.num_neighbours)
  options = (("block_bias", bool(block_bias)), ("heads", heads), ("radius", int(radius_blocks)))
  offset = (None if far_offset is None
            else jnp.asarray(far_offset).astype(_F32).reshape(heads, 1, 1))
  o = _attend(q_s, k_s, v_s, kbar.astype(q.dtype), vbar.astype(q.dtype), offset, tables, cfg,
              options)
  return poison_overflow(layout, _from_slots(layout, o, heads))
