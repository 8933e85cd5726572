"""Pack3D attention as Pallas kernels, forward and backward.

Math and shapes: `jaxops.pack3d` (the reference this kernel is tested against). Tokens
are scattered into the cube-major layout of `jaxops.pack3d_layout.cube_layout` (a cube is a
contiguous slab of T slots, empty slots masked; each slot H * D values, the heads side by
side on the lanes, and for the Mosaic kernels g = 128 / gcd(H * D, 128) slots side by side
per row (`tiles.lane_groups`, `jaxops.pack3d_layout.group_rows`): no lane padding in TPU
HBM), the summaries kbar, vbar are
precomputed in XLA (`cube_summaries`), and for each (batch, head, query cube) the kernel
runs ONE online softmax over two key streams: its <= (2r+1)^3 neighbour cubes, then the
cube summaries, whose far-or-not bias it derives from the cubes' keys (plus the head's
far offset, if given). On TPU one program serves all heads of a query cube.
With `levels` >= 2 (DESIGN.md section 3.1) the summary stream holds every level's summaries,
level 1's then those of levels 2..L (count-weighted means of level 1's, built in XLA by
`jaxops.pack3d_levels`, so their gradients reach the tokens by autodiff), and the far test
(`tiles.far_bias_of`) picks each query cube's Far_1, ..., Far_L from them. The kernels still
visit every summary block per query cube (O(C x summaries), like one level): the far field
is exact but not near-linear here; skipping the blocks a query cube has no far summary in is
the follow-up, and the near-linear cost is the XLA path's (`jaxops.pack3d`).
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
`pallas_kernels.dispatch` (Mosaic on TPU; Triton on a CUDA GPU: the Mosaic GPU body, for
Hopper with 16-bit inputs and cubes of 33 to 64 tokens, has run on no chip, so it is opt-in;
interpret mode on CPU).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from neurips26_jax.jaxops import pack3d_levels as levels_lib
from neurips26_jax.jaxops.pack3d import MASK, check_pack3d_inputs, cube_summaries
from neurips26_jax.jaxops.pack3d_layout import (cube_layout, group_rows, poison_overflow,
                                                ungroup_rows)
from neurips26_jax.jaxops.tiling import next_pow2
from neurips26_jax.pallas_kernels.dispatch import Backend, KernelConfig, dispatch, traced_body
from neurips26_jax.pallas_kernels.pack3d_attention import mosaic, mosaic_gpu, triton
from neurips26_jax.pallas_kernels.pack3d_attention.blocks import TUNED, BlockSizes
from neurips26_jax.pallas_kernels.pack3d_attention.tiles import Tables, TilePlan, lane_groups

__all__ = ["BlockSizes", "TUNED", "pack3d_attention"]

_F32 = jnp.float32
_KERNELS = {"mosaic": mosaic, "triton": triton, "mosaic_gpu": mosaic_gpu}


def _plan(backend: Backend, interpret, blocks: BlockSizes, q, tables: Tables, offset, options):
  return TilePlan.make(backend, blocks, q, tables, compiled=not interpret,
                       far_offset=offset is not None,
                       offset_levels=1 if offset is None else offset.shape[2], **options)


def _body_layout(backend: Backend, tables: Tables, options, tokens):
  """The token operands (grouped g slots per row, `tiles.lane_groups`) as `backend`'s body
  reads them: as they are for Mosaic; one slot per row for the GPU kernels (a GPU branch
  gets g > 1 only when traced beside a TPU one, or forced to run interpreted), and the
  options that say so. Returns (tokens, options, to_operands: its outputs back to g)."""
  groups, t = options["groups"], tables.key_bias.shape[3]
  if backend == "mosaic" or groups == 1:
    return tokens, options, lambda x: x
  return ([ungroup_rows(x, t, groups) for x in tokens], dict(options, groups=1),
          lambda x: group_rows(x, t, groups))


def _forward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar, offset,
             tables: Tables, *, options):
  (q, k, v), options, regroup = _body_layout(backend, tables, options, (q, k, v))
  plan = _plan(backend, interpret, blocks, q, tables, offset, options)
  kbar, vbar, tables = plan.pad_summaries(kbar, vbar, tables)
  o, lse = _KERNELS[backend].forward(plan, blocks, interpret, q, k, v, kbar, vbar, offset,
                                     tables)
  return regroup(o), lse


def _backward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar, offset,
              tables: Tables, o, lse, do, *, options):
  # delta = per-head rowsum(do * o) [B, C, H, T], the head sums as a matmul against the
  # lanes' (group, head) indicator (splitting the lanes into [H, D] would pad D on TPU);
  # slot j T/g + i of a cube sits in its row i, lane group j (`group_rows`)
  groups, heads, t = options["groups"], options["heads"], tables.key_bias.shape[3]
  lanes = jnp.arange(o.shape[2])
  slot_width = o.shape[2] // groups
  group_of, head_of = lanes // slot_width, lanes % slot_width // (slot_width // heads)
  indicator = ((group_of[:, None, None] == jnp.arange(groups)[:, None])
               & (head_of[:, None, None] == jnp.arange(heads)))       # [g*H*D, g, H]
  product = (do.astype(_F32) * o.astype(_F32)).reshape(o.shape[0], -1, t // groups, o.shape[2])
  delta = jnp.einsum("bcix,xjh->bchji", product, indicator.astype(_F32),
                     precision=jax.lax.Precision.HIGHEST).reshape(*product.shape[:2], heads, t)
  (q, k, v, do), options, regroup = _body_layout(backend, tables, options,
                                                 (q, k, v, do.astype(q.dtype)))
  plan = _plan(backend, interpret, blocks, q, tables, offset, options)
  kbar_p, vbar_p, tables = plan.pad_summaries(kbar, vbar, tables)
  grads = _KERNELS[backend].backward(plan, blocks, interpret, q, k, v, kbar_p, vbar_p, offset,
                                     tables, do, lse, delta)
  grads = (*(regroup(x) for x in grads[:3]), *grads[3:])
  dkbar, dvbar = (g[:, :plan.summaries] for g in grads[3:5])
  # [B, H, Cs] per-summary parts (padded summaries are never far: 0) -> [H, 1, Lo]
  d_offset = None
  if offset is not None and plan.offset_levels == 1:
    d_offset = jnp.sum(grads[5], axis=(0, 2))[:, None, None]
  elif offset is not None:  # each summary's part to its level's beta (row 5: the level)
    of_level = (tables.cube_rows[:, None, 5, :, None]
                == jnp.arange(1, plan.offset_levels + 1, dtype=_F32))      # [B, 1, Cs, L]
    d_offset = jnp.sum(jnp.where(of_level, grads[5][..., None], 0.0), axis=(0, 2))[:, None]
  return *grads[:3], dkbar, dvbar, d_offset


def _lane_groups(cfg: KernelConfig, t: int, width: int, dtype) -> int:
  """g slots per token-operand row (`tiles.lane_groups`) where the Mosaic body runs, else 1."""
  backend, interpreted = traced_body(cfg, dtype)
  return lane_groups(t, width, dtype, compiled=not interpreted) if backend == "mosaic" else 1


def _to_slots(layout, x, groups: int):
  """[B, N, H, D] -> cube slots with the heads on the lanes, g = groups per row
  [B, C * T / g, g * H * D], empty slots zero: on TPU an [N, H, D] array pads both minor
  dims (D = 24 to 128 lanes), an [N, H * D] one only H * D, a [.., g * H * D] one nothing."""
  batch, n, heads, d = x.shape
  return layout.to_slot_rows(x.reshape(batch, n, heads * d), groups)


def _from_slots(layout, o, heads: int, groups: int):
  """Inverse of `_to_slots`: [B, C * T / g, g * H * D] -> [B, N, H, D]."""
  rows = layout.from_slot_rows(o, groups)
  return rows.reshape(*rows.shape[:2], heads, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def attend(q, k, v, kbar, vbar, offset, tables, cfg: KernelConfig, options):
  """offset: None, or beta [H, 1, Lo] float32 (then differentiable too): Lo = 1, one beta
  per head for every level, or Lo = L, beta_{k,h} at [h, 0, k - 1]."""
  return _attend_fwd(q, k, v, kbar, vbar, offset, tables, cfg, options)[0]


def _attend_fwd(q, k, v, kbar, vbar, offset, tables, cfg, options):
  fwd = functools.partial(_forward, options=dict(options))
  o, lse = dispatch(fwd, cfg, q, k, v, kbar, vbar, offset, tables)
  return o, (q, k, v, kbar, vbar, offset, tables, o, lse)


def _attend_bwd(cfg, options, residuals, do):
  grads = dispatch(functools.partial(_backward, options=dict(options)), cfg, *residuals, do)
  return (*grads, None)


attend.defvjp(_attend_fwd, _attend_bwd)


def _level_summaries(layout, kbar, vbar, rows, levels: int, max_top_cubes, key_gain: float):
  """Every level's summaries as the kernels' far stream: level 1's C cubes (kbar, vbar
  [B, C, H*D] float32, rows = `layout.cube_rows()` [B, 8, C]) followed by those of levels
  2..L, count-weighted means of level 1's, level k's keys times key_gain^(k-1)
  (`pack3d_levels.level_structure`), each in its
  `pack3d_levels.level_slots` (exact for concrete coords; for traced ones bounded by
  max_top_cubes, so that a 1M-token grid's levels add ~1/7 of level 1's summaries, not C
  per level). Row 5 of the table is each summary's level k, rows 1..3 its level-k cube
  (`tiles.far_bias`).

  Returns kbar, vbar [B, M, H*D], rows [B, 8, M] (M the summaries of all levels) and the top
  level's slots (an entry needing more gets NaN: `pack3d_levels.poison_top_overflow`)."""
  keys, count = layout.keys, layout.count
  # [B, C, 1, H*D]: pack3d_levels' [C, H, D] summaries with the heads kept on the lanes
  per_level = jax.vmap(lambda *a: levels_lib.level_structure(*a, levels, key_gain))(
      keys, count, kbar[:, :, None], vbar[:, :, None])
  tagged = lambda r, k: r.at[:, 5].set(float(k))               # row 5: the level
  kbars, vbars, tables = [kbar], [vbar], [tagged(rows, 1)]
  level_slots = levels_lib.level_slots(keys, count, levels, max_top_cubes)
  for k, slots in enumerate(level_slots, 2):
    keys_k, count_k, kbar_k, vbar_k, _ = per_level[k - 1]
    kbars.append(kbar_k[:, :slots, 0])
    vbars.append(vbar_k[:, :slots, 0])
    cols = jnp.concatenate([keys_k[:, :slots].astype(_F32), count_k[:, :slots, None],
                            jnp.zeros(count_k[:, :slots].shape + (3,), _F32)], axis=-1)
    tables.append(tagged(jnp.swapaxes(cols, 1, 2), k))
  return (jnp.concatenate(kbars, 1), jnp.concatenate(vbars, 1), jnp.concatenate(tables, 2),
          level_slots[-1])


def pack3d_attention(q: jax.Array, k: jax.Array, v: jax.Array, coords: ArrayLike,
                     field_ids: ArrayLike, *, block_shape: Sequence[int] = (4, 4, 4),
                     radius_blocks: int = 1, block_bias: bool = True,
                     summary_rope: dict[str, Any] | None = None,
                     far_offset: ArrayLike | None = None, max_cubes: int | None = None,
                     levels: int = 1, level_radius: int | Sequence[int] | None = None,
                     max_top_cubes: int | None = None, level_key_gain: float | None = None,
                     interpret: Any = None, backend: Backend | None = None,
                     **block_sizes: int) -> jax.Array:
  """Pack3D attention as Pallas kernels, differentiable in q, k, v (and far_offset).

  Args:
    q, k, v: [B, N, H, D] (q, k already rotated), float32 or bfloat16.
    coords: int [B, N, 3] (z, y, x) in each token's field; field_ids: int [B, N].
    block_shape, radius_blocks, block_bias, summary_rope, max_cubes: as in
      `jaxops.pack3d.pack3d_attention` (the gated merge is an XLA-path option only).
      With traced coords, an entry needing more than max_cubes cubes gets NaN outputs
      (`jaxops.pack3d_layout.layout_status` says which and why).
    far_offset: None, or beta [H] (float) added to every far-summary logit of its head (of
      every level), or with levels >= 2 [levels, H], row k - 1 on level k; None leaves the
      kernels exactly as without it (no offset operand, no gradient output).
    levels, level_radius, max_top_cubes, level_key_gain: the multi-level far field, as in
      `jaxops.pack3d.pack3d_attention` (DESIGN.md section 3.1); levels=1 is the single level.
      The kernels visit every summary of every level per query cube (module docstring).
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Triton; Mosaic
      GPU where forced or measured faster, `dispatch.gpu_backend`); True (or the
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
  operands, cfg, options, finish = kernel_operands(
      q, k, v, coords, field_ids, block_shape=block_shape, radius_blocks=radius_blocks,
      block_bias=block_bias, summary_rope=summary_rope, far_offset=far_offset,
      max_cubes=max_cubes, levels=levels, level_radius=level_radius,
      max_top_cubes=max_top_cubes, level_key_gain=level_key_gain, interpret=interpret,
      backend=backend, **block_sizes)
  return finish(attend(*operands, cfg, options))


def kernel_operands(q: jax.Array, k: jax.Array, v: jax.Array, coords: ArrayLike,
                    field_ids: ArrayLike, *, block_shape: Sequence[int], radius_blocks: int,
                    block_bias: bool, summary_rope: dict[str, Any] | None,
                    far_offset: ArrayLike | None, max_cubes: int | None, levels: int,
                    level_radius: int | Sequence[int] | None, max_top_cubes: int | None,
                    level_key_gain: float | None, interpret: Any, backend: Backend | None,
                    **block_sizes: int) -> tuple[tuple, KernelConfig, tuple, Callable]:
  """`pack3d_attention`'s XLA stage: checks, the cube layout, slots and summaries.

  Returns (operands, cfg, options, finish): `attend(*operands, cfg, options)` runs the
  kernels (differentiable in operands[:6]) and `finish` maps their output back to tokens.
  Split out so that `make perf-tpu` can profile the kernels alone (the layout's gathers
  abort libtpu's profiler).
  """
  radii = levels_lib.level_radii(radius_blocks, levels, level_radius)
  key_gain = levels_lib.check_level_options(levels, max_top_cubes, level_key_gain,
                                            summary_rope=summary_rope)
  per_level = levels > 1 and far_offset is not None and jnp.ndim(far_offset) == 2
  offset_levels = levels if per_level else 1
  if offset_levels > 1:  # [L, H] per level (shape checked there), its first row for the rest
    far_offset = levels_lib.offsets_per_level(far_offset, levels, q.shape[2])
  check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks,
                      far_offset=far_offset if offset_levels == 1 else far_offset[0])
  slots = next_pow2(math.prod(block_shape))
  reason = mosaic_gpu.unsupported(slots, block_shape, q.shape[-1],
                                  block_sizes.get("block_summaries"))
  if backend == "mosaic_gpu" and reason:
    raise ValueError(f"pack3d_attention: backend='mosaic_gpu' {reason}: use backend='triton' "
                     "or None")
  backends = ("mosaic", "triton") + (() if reason else ("mosaic_gpu",))
  cfg = KernelConfig.make("pack3d_attention", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes, backends=backends)
  layout = cube_layout(coords, field_ids, block_shape=block_shape, radius_blocks=radius_blocks,
                       max_cubes=max_cubes, slots_per_cube=slots)
  batch, n, heads, d = q.shape
  cubes, t = layout.num_cubes, layout.slots_per_cube
  groups = _lane_groups(cfg, t, heads * d, q.dtype)
  q_s, k_s, v_s = (_to_slots(layout, x, groups) for x in (q, k, v))  # [B, C*T/g, g*H*D]
  if summary_rope is None:  # cube means straight from the slots (in any order)
    inv_n = 1.0 / jnp.maximum(layout.count, 1.0)[:, :, None]
    # the rows summed first, over the slots' own [.., g*H*D] shape: the gradient broadcasts
    # back to that shape (through [B, C, T, H*D] it would pad H*D to 128 lanes on TPU)
    row_sums = lambda x: jnp.sum(x.reshape(batch, cubes, t // groups, -1).astype(_F32), 2)
    mean = lambda x: jnp.sum(row_sums(x).reshape(batch, cubes, groups, -1), 2) * inv_n
    kbar, vbar = mean(k_s), mean(v_s)                             # [B, C, H * D]
  else:
    kbar, vbar = (s.reshape(batch, cubes, heads * d) for s in cube_summaries(
        layout, layout.to_cubes(k), layout.to_cubes(v), coords, summary_rope))
  rows = layout.cube_rows()
  cols = jnp.swapaxes(rows, 1, 2)                                 # the level-1 query cubes
  if levels > 1:
    kbar, vbar, rows, top_slots = _level_summaries(layout, kbar, vbar, rows, levels,
                                                  max_top_cubes, key_gain)
  tables = Tables(key_bias=jnp.where(layout.key_valid(), 0.0, MASK)[:, :, None, :],
                  cube_rows=rows, cube_cols=cols,
                  neighbours=layout.neighbours, num_neighbours=layout.num_neighbours)
  options = (("block_bias", bool(block_bias)), ("heads", heads), ("radii", radii),
             ("groups", groups))
  if far_offset is None:
    offset = None
  elif offset_levels == 1:
    offset = jnp.asarray(far_offset).astype(_F32).reshape(heads, 1, 1)
  else:  # [L, H] -> [H, 1, L]
    offset = jnp.swapaxes(far_offset, 0, 1)[:, None, :]
  operands = (q_s, k_s, v_s, kbar.astype(q.dtype), vbar.astype(q.dtype), offset, tables)
  finish = functools.partial(_finish, layout, heads, groups, levels,
                             top_slots if levels > 1 else None)
  return operands, cfg, tuple(options), finish


def _finish(layout, heads: int, groups: int, levels: int, top_slots, o):
  """The kernels' output in slots -> [B, N, H, D], NaN where the layout overflowed."""
  o = poison_overflow(layout, _from_slots(layout, o, heads, groups))
  if levels > 1:
    o = levels_lib.poison_top_overflow(o, layout.keys, layout.count, levels, top_slots)
  return o
