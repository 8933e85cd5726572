"""Pack3D attention on GPU (Triton): one program per (b, h, cube); grid steps cannot carry
state, so the two key streams are fori_loops inside, reading tiles from refs passed whole
(k/v rows `pl.ds(pl.multiple_of(c * T, T), T)` of neighbour cube c). The kernels work
head-major ([B, H, C*T, d] operands, lse and delta [B, H, C*T, 1]): `forward` and
`backward` move the heads out of the lanes of the shared layout (`tiles`) and back, and pad
D to a power of two d, as Triton blocks must be. With a far offset, the forward, dq and summary
kernels read their head's beta ([1, 1, 1] block) and the summary kernel also writes
per-summary sums of the far scores' gradient (d beta); without one (off_ref, doff_ref None)
neither exists (`tiles.absent_refs`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from neurips26_jax.jaxops.tiling import next_pow2
from neurips26_jax.pallas_kernels.pack3d_attention import tiles
from neurips26_jax.pallas_kernels.pack3d_attention.tiles import Tables, TilePlan

_F32 = jnp.float32


def _rows(c, t):
  return pl.ds(pl.multiple_of(c * t, t), t)


def _neighbour_loop(nbr_ref, nnb_ref, body, init):
  """fori_loop over this program's neighbour cubes: body(c, carry) -> carry."""
  return jax.lax.fori_loop(0, nnb_ref[0, 0], lambda j, carry: body(nbr_ref[0, 0, j], carry),
                           init)


def _offset(plan: TilePlan, off_ref):
  """The head's far offset [1, 1] (per level: a tuple of them, `tiles.head_offsets`), or
  None."""
  return None if off_ref is None else tiles.head_offsets(off_ref[0], plan.offset_levels)


def _offset_lanes(plan: TilePlan, offset):
  """The far offsets [H, 1, Lo] with Lo padded to a power of two (Triton blocks)."""
  if offset is None or plan.offset_levels == 1:
    return offset
  return jnp.pad(offset, ((0, 0), (0, 0), (0, _offset_width(plan) - plan.offset_levels)))


def _offset_width(plan: TilePlan) -> int:
  """Lo rounded up to a power of two (1 stays 1)."""
  return next_pow2(plan.offset_levels, minimum=1)


def _summary_loop(plan: TilePlan, cols_ref, rows_ref, off_ref, body, init):
  """fori_loop over the summary blocks: body(cols, far bias [1, S], carry) -> carry."""
  key = tiles.query_key(cols_ref[0], 0)
  s = plan.s_block

  def step(i, carry):
    cols = _rows(i, s)
    bias = tiles.far_bias(key, rows_ref[0, :, cols], plan.radii, plan.block_bias,
                          _offset(plan, off_ref))
    return body(cols, bias, carry)

  return jax.lax.fori_loop(0, plan.summary_blocks, step, init)


def _fwd_kernel(nbr_ref, nnb_ref, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref, rows_ref,
                cols_ref, off_ref, o_ref, lse_ref, *, plan: TilePlan):
  q, t = q_ref[0, 0], plan.t

  def local(c, state):
    return tiles.softmax_step(state, q, k_ref[0, 0, _rows(c, t), :], v_ref[0, 0, _rows(c, t), :],
                              kb_ref[0, c], plan.scale)

  def far(cols, bias, state):
    return tiles.softmax_step(state, q, kbar_ref[0, 0, cols, :], vbar_ref[0, 0, cols, :], bias,
                              plan.scale)

  state = _neighbour_loop(nbr_ref, nnb_ref, local, tiles.init_state(*q.shape))
  o, lse = tiles.finish(*_summary_loop(plan, cols_ref, rows_ref, off_ref, far, state))
  o_ref[0, 0] = o.astype(o_ref.dtype)
  lse_ref[0, 0] = lse


def _dq_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
               kbar_ref, vbar_ref, rows_ref, cols_ref, off_ref, dq_ref, *, plan: TilePlan):
  q, do, lse, delta, t = q_ref[0, 0], do_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0], plan.t

  def local(c, dq):
    return dq + tiles.dq_step(q, k_ref[0, 0, _rows(c, t), :], v_ref[0, 0, _rows(c, t), :],
                              kb_ref[0, c], do, lse, delta, plan.scale)

  def far(cols, bias, dq):
    return dq + tiles.dq_step(q, kbar_ref[0, 0, cols, :], vbar_ref[0, 0, cols, :], bias, do,
                              lse, delta, plan.scale)

  dq = _neighbour_loop(nbr_ref, nnb_ref, local, jnp.zeros(q.shape, _F32))
  dq_ref[0, 0] = _summary_loop(plan, cols_ref, rows_ref, off_ref, far, dq).astype(dq_ref.dtype)


def _dkv_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                dk_ref, dv_ref, *, plan: TilePlan):
  """dK, dV of one key cube: one loop over (neighbour cube, block of its query rows)."""
  k, v, bias, r = k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0], plan.dkv_rows
  parts = plan.t // r

  def step(j, carry):
    # lax.div/rem: j >= 0, and jnp's floor division lowers to sign fix-ups Triton rejects
    rows = _rows(nbr_ref[0, 0, jax.lax.div(j, parts)] * parts + jax.lax.rem(j, parts), r)
    dk, dv = tiles.dkv_step(q_ref[0, 0, rows, :], k, v, bias, do_ref[0, 0, rows, :],
                            lse_ref[0, 0, rows, :], delta_ref[0, 0, rows, :], plan.scale)
    return carry[0] + dk, carry[1] + dv

  init = (jnp.zeros(k.shape, _F32),) * 2
  dk, dv = jax.lax.fori_loop(0, nnb_ref[0, 0] * parts, step, init)
  dk_ref[0, 0] = dk.astype(dk_ref.dtype)
  dv_ref[0, 0] = dv.astype(dv_ref.dtype)


def _dsummary_kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, rows_ref, cols_ref,
                     off_ref, dkbar_ref, dvbar_ref, doff_ref, *, plan: TilePlan):
  kbar, vbar, t = kbar_ref[0, 0], vbar_ref[0, 0], plan.t
  rows, offset = rows_ref[0], _offset(plan, off_ref)

  def query_cube(a, carry):
    toks = _rows(a, t)
    key = tiles.query_key(cols_ref[0, pl.ds(a, 1), :], 0)
    bias = tiles.far_bias(key, rows, plan.radii, plan.block_bias, offset)
    tile = (q_ref[0, 0, toks, :], kbar, vbar, bias, do_ref[0, 0, toks, :],
            lse_ref[0, 0, toks, :], delta_ref[0, 0, toks, :], plan.scale)
    if doff_ref is None:
      dk, dv = tiles.dkv_step(*tile)
      return carry[0] + dk, carry[1] + dv
    dk, dv, ds_sum = tiles.dsummary_step(*tile)
    return carry[0] + dk, carry[1] + dv, carry[2] + ds_sum

  init = (jnp.zeros(kbar.shape, _F32),) * 2
  if doff_ref is not None:
    init += (jnp.zeros((1, kbar.shape[0]), _F32),)
  sums = jax.lax.fori_loop(0, plan.cubes, query_cube, init)
  dkbar_ref[0, 0] = sums[0].astype(dkbar_ref.dtype)
  dvbar_ref[0, 0] = sums[1].astype(dvbar_ref.dtype)
  if doff_ref is not None:
    doff_ref[0, 0] = sums[2]


def _call(kernel, plan: TilePlan, grid, in_specs, out_specs, out_shape, interpret, name,
          warps_and_stages, *args, takes_offset=False, absent=()):
  """takes_offset: the last of `args` is the far offset, left out (with its spec) when None;
  absent: positions in the kernel's argument list that get None (`tiles.absent_refs`)."""
  num_warps, num_stages = warps_and_stages
  if takes_offset and args[-1] is None:
    args, in_specs, absent = args[:-1], in_specs[:-1], (len(args) - 1,)
  return pl.pallas_call(
      tiles.absent_refs(functools.partial(kernel, plan=plan), absent), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
      compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
  )(*args)


def _split_heads(plan: TilePlan, x):
  """[B, R, H*D] -> [B, H, R, d] (D zero-padded to d)."""
  x = jnp.swapaxes(x.reshape(x.shape[0], x.shape[1], plan.heads, plan.head_dim), 1, 2)
  return jnp.pad(x, ((0, 0),) * 3 + ((0, plan.d - plan.head_dim),))


def _merge_heads(plan: TilePlan, x):
  """Inverse of `_split_heads`: [B, H, R, d] -> [B, R, H*D]."""
  x = jnp.swapaxes(x[..., :plan.head_dim], 1, 2)
  return x.reshape(x.shape[0], x.shape[1], plan.heads * plan.head_dim)


def _stats_to_rows(plan: TilePlan, x):
  """Per-row statistics [B, C, H, T] -> [B, H, C*T, 1]."""
  return jnp.swapaxes(x, 1, 2).reshape(plan.batch, plan.heads, plan.cubes * plan.t, 1)


def _rows_to_stats(plan: TilePlan, x):
  """Inverse of `_stats_to_rows`."""
  return jnp.swapaxes(x.reshape(plan.batch, plan.heads, plan.cubes, plan.t), 1, 2)


class _Specs:
  """Specs on grid (b, h, cube a): this cube's tiles, whole arrays, and the tables."""

  def __init__(self, plan: TilePlan):
    cubes, t, d, k_max = plan.cubes, plan.t, plan.d, plan.k_max
    n = cubes * t
    self.own = pl.BlockSpec((1, 1, t, d), lambda b, h, a: (b, h, a, 0))
    self.own_rows = pl.BlockSpec((1, 1, t, 1), lambda b, h, a: (b, h, a, 0))
    self.whole = pl.BlockSpec((1, 1, n, d), lambda b, h, a: (b, h, 0, 0))
    self.whole_rows = pl.BlockSpec((1, 1, n, 1), lambda b, h, a: (b, h, 0, 0))
    self.key_bias_all = pl.BlockSpec((1, cubes, 1, t), lambda b, h, a: (b, 0, 0, 0))
    self.key_bias_own = pl.BlockSpec((1, 1, 1, t), lambda b, h, a: (b, a, 0, 0))
    self.summ = pl.BlockSpec((1, 1, plan.c_s, d), lambda b, h, a: (b, h, 0, 0))
    self.rows = pl.BlockSpec((1, 8, plan.c_s), lambda b, h, a: (b, 0, 0))
    self.cols = pl.BlockSpec((1, 1, 8), lambda b, h, a: (b, a, 0))
    self.nbr = pl.BlockSpec((1, 1, k_max), lambda b, h, a: (b, a, 0))
    self.nnb = pl.BlockSpec((1, 1), lambda b, h, a: (b, a))
    self.offset = pl.BlockSpec((1, 1, _offset_width(plan)), lambda b, h, a: (h, 0, 0))


def forward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables):
  """o [B, C*T, H*D] and lse [B, C, H, T] from the shared layout (`tiles`)."""
  o, lse = _forward(plan, blocks, interpret, *(_split_heads(plan, x) for x in (q, k, v, kbar, vbar)),
                    _offset_lanes(plan, offset), tables)
  return _merge_heads(plan, o), _rows_to_stats(plan, lse)


def backward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables,
             do, lse, delta):
  """dq, dk, dv, dkbar, dvbar in the shared layout and, with a far offset, its per-summary
  parts [B, H, Cs]."""
  heads = [_split_heads(plan, x) for x in (q, k, v, kbar, vbar)]
  grads = _backward(plan, blocks, interpret, *heads, _offset_lanes(plan, offset), tables,
                    _split_heads(plan, do), *(_stats_to_rows(plan, x) for x in (lse, delta)))
  return (*(_merge_heads(plan, g) for g in grads[:5]),
          *(g.reshape(plan.batch, plan.heads, plan.c_s) for g in grads[5:]))


def _forward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables):
  sp = _Specs(plan)
  rows = jax.ShapeDtypeStruct((plan.batch, plan.heads, plan.cubes * plan.t, 1), _F32)
  return _call(
      _fwd_kernel, plan, (plan.batch, plan.heads, plan.cubes),
      [sp.nbr, sp.nnb, sp.own, sp.whole, sp.whole, sp.key_bias_all, sp.summ, sp.summ, sp.rows,
       sp.cols, sp.offset],
      [sp.own, sp.own_rows], [jax.ShapeDtypeStruct(q.shape, q.dtype), rows],
      interpret, "pack3d_fwd", (blocks.num_warps, blocks.num_stages), tables.neighbours,
      tables.num_neighbours, q, k, v, tables.key_bias, kbar, vbar, tables.cube_rows,
      tables.cube_cols, offset, takes_offset=True)


def _backward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables,
              do, lse, delta):
  """Head-major dq, dk, dv, dkbar, dvbar and, with a far offset, its per-summary parts
  [B, H, 1, Cs]."""
  sp = _Specs(plan)
  grid = (plan.batch, plan.heads, plan.cubes)
  nbr = (tables.neighbours, tables.num_neighbours)
  dq = _call(
      _dq_kernel, plan, grid,
      [sp.nbr, sp.nnb, sp.own, sp.own, sp.own_rows, sp.own_rows, sp.whole, sp.whole,
       sp.key_bias_all, sp.summ, sp.summ, sp.rows, sp.cols, sp.offset],
      sp.own, jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "pack3d_bwd_dq",
      (blocks.num_warps, blocks.num_stages), *nbr, q, do, lse, delta, k, v, tables.key_bias,
      kbar, vbar, tables.cube_rows, tables.cube_cols, offset, takes_offset=True)
  dk, dv = _call(
      _dkv_kernel, plan, grid,
      [sp.nbr, sp.nnb, sp.whole, sp.whole, sp.whole_rows, sp.whole_rows, sp.own, sp.own,
       sp.key_bias_own],
      [sp.own, sp.own],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret, "pack3d_bwd_dkv", (blocks.num_warps_bwd, blocks.num_stages), *nbr, q, do, lse, delta, k, v,
      tables.key_bias)
  s, d, n = plan.s_block, plan.d, plan.cubes * plan.t
  whole = pl.BlockSpec((1, 1, n, d), lambda b, h, i: (b, h, 0, 0))
  whole_rows = pl.BlockSpec((1, 1, n, 1), lambda b, h, i: (b, h, 0, 0))
  summ = pl.BlockSpec((1, 1, s, d), lambda b, h, i: (b, h, i, 0))
  rows = pl.BlockSpec((1, 8, s), lambda b, h, i: (b, 0, i))
  cols = pl.BlockSpec((1, plan.cubes, 8), lambda b, h, i: (b, 0, 0))
  in_specs = [whole, whole, whole_rows, whole_rows, summ, summ, rows, cols]
  args = [q, do, lse, delta, kbar, vbar, tables.cube_rows, tables.cube_cols]
  out_specs, out_shape = [summ, summ], [jax.ShapeDtypeStruct(kbar.shape, kbar.dtype)] * 2
  absent = ()
  if plan.far_offset:  # beta_h in; per-summary sums of ds [1, S] out
    in_specs.append(pl.BlockSpec((1, 1, _offset_width(plan)), lambda b, h, i: (h, 0, 0)))
    args.append(offset)
    out_specs.append(pl.BlockSpec((1, 1, 1, s), lambda b, h, i: (b, h, 0, i)))
    out_shape.append(jax.ShapeDtypeStruct((plan.batch, plan.heads, 1, plan.c_s), _F32))
  else:  # off_ref and doff_ref in the kernel's argument list
    absent = (8, 11)
  summaries = _call(
      _dsummary_kernel, plan, (plan.batch, plan.heads, plan.summary_blocks), in_specs,
      out_specs, out_shape, interpret, "pack3d_bwd_dsummary",
      (blocks.num_warps_bwd, blocks.num_stages), *args, absent=absent)
  return dq, dk, dv, *summaries
