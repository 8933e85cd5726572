"""Pack3D attention on TPU (Mosaic).

Forward, dq and dk/dv: `PrefetchScalarGridSpec` with the neighbour table in SMEM; grid
(head h, query cube a, stream step j), j walking the K neighbour cubes then the summary
blocks; k/v `index_map`s read the table; VMEM scratch carries the softmax state. SMEM
holds 1 MiB, so the calls loop over (batch entry, block of `cubes_per_call` query cubes)
and each prefetches only its block's rows of the table (plus (b, first cube) as scalars).
The summary gradients run as one call on grid (b, h, summary block, query cube).
With a far offset, the forward, dq and summary kernels take their head's beta as a
[1, 1, 1] block, and the summary kernel also writes per-summary sums of the far scores'
gradient (d beta); without one, neither operand nor output exists (`tiles.absent_refs`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxops.tiling import round_up
from pallas_kernels.pack3d_attention import tiles
from pallas_kernels.pack3d_attention.tiles import Tables, TilePlan

_F32 = jnp.float32


def _eighth(cube):
  """cube // 8 for cube >= 0 (jnp's floor division lowers through sign, which asks for the
  TPU generation and so cannot lower from CPU)."""
  return jax.lax.div(cube, 8)


def _far(plan: TilePlan, cols_ref, rows_ref, cube, off_ref):
  """Far biases [1, S] of query cube `cube` (row cube % 8 of its 8-cube block of cube_cols),
  plus the head's far offset (off_ref None: none)."""
  return tiles.far_bias(tiles.query_key(cols_ref[0], jax.lax.rem(cube, 8)), rows_ref[0],
                        plan.radius, plan.block_bias, None if off_ref is None else off_ref[0])


# ----------------------------------------------------------------------------
# Kernels. Prefetched refs: meta = (b, first query cube of the call), nbr [cc * K], nnb [cc].
# off_ref (the head's far offset) and the summary kernel's doff_ref, doff_sc are None when
# the call has no far offset.
# ----------------------------------------------------------------------------

def _fwd_kernel(meta, nbr, nnb, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref, rows_ref,
                cols_ref, off_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, plan: TilePlan):
  a, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    m_sc[...], l_sc[...], acc_sc[...] = tiles.init_state(*acc_sc.shape)

  def update(k, v, bias):
    state = (m_sc[...], l_sc[...], acc_sc[...])
    m_sc[...], l_sc[...], acc_sc[...] = tiles.softmax_step(state, q_ref[0, 0], k, v, bias,
                                                           plan.scale)

  pl.when(j < nnb[a])(lambda: update(k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0]))
  pl.when(j >= plan.k_max)(lambda: update(kbar_ref[0, 0], vbar_ref[0, 0],
                                          _far(plan, cols_ref, rows_ref, meta[1] + a, off_ref)))

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    o, lse = tiles.finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[0, 0] = o.astype(o_ref.dtype)
    lse_ref[0, 0] = lse


def _dq_kernel(meta, nbr, nnb, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
               kbar_ref, vbar_ref, rows_ref, cols_ref, off_ref, dq_ref, dq_sc, *,
               plan: TilePlan):
  a, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def update(k, v, bias):
    dq_sc[...] += tiles.dq_step(q_ref[0, 0], k, v, bias, do_ref[0, 0], lse_ref[0, 0],
                                delta_ref[0, 0], plan.scale)

  pl.when(j < nnb[a])(lambda: update(k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0]))
  pl.when(j >= plan.k_max)(lambda: update(kbar_ref[0, 0], vbar_ref[0, 0],
                                          _far(plan, cols_ref, rows_ref, meta[1] + a, off_ref)))

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    dq_ref[0, 0] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(meta, nbr, nnb, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                dk_ref, dv_ref, dk_sc, dv_sc, *, plan: TilePlan):
  """Key cube a; step j visits query cube nbr[a, j] (the relation is symmetric)."""
  a, j = pl.program_id(1), pl.program_id(2)

  @pl.when(j == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  @pl.when(j < nnb[a])
  def _():
    dk, dv = tiles.dkv_step(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0], do_ref[0, 0],
                            lse_ref[0, 0], delta_ref[0, 0], plan.scale)
    dk_sc[...] += dk
    dv_sc[...] += dv

  @pl.when(j == pl.num_programs(2) - 1)
  def _():
    dk_ref[0, 0] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dsummary_kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, rows_ref, cols_ref,
                     off_ref, dkbar_ref, dvbar_ref, doff_ref, dk_sc, dv_sc, doff_sc, *,
                     plan: TilePlan):
  """Summary block s; step a visits every query cube (the far bias masks the others)."""
  a = pl.program_id(3)

  @pl.when(a == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)
    if doff_sc is not None:
      doff_sc[...] = jnp.zeros_like(doff_sc)

  tile = (q_ref[0, 0], kbar_ref[0, 0], vbar_ref[0, 0], _far(plan, cols_ref, rows_ref, a, off_ref),
          do_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0], plan.scale)
  if doff_sc is None:
    dk, dv = tiles.dkv_step(*tile)
  else:
    dk, dv, ds_sum = tiles.dsummary_step(*tile)
    doff_sc[...] += ds_sum
  dk_sc[...] += dk
  dv_sc[...] += dv

  @pl.when(a == pl.num_programs(3) - 1)
  def _():
    dkbar_ref[0, 0] = dk_sc[...].astype(dkbar_ref.dtype)
    dvbar_ref[0, 0] = dv_sc[...].astype(dvbar_ref.dtype)
    if doff_ref is not None:
      doff_ref[0, 0] = doff_sc[...]


# ----------------------------------------------------------------------------
# Calls.
# ----------------------------------------------------------------------------

def _padded_cols(plan: TilePlan, tables: Tables, cubes: int):
  """cube_cols padded to a multiple of 8 rows covering `cubes` (its blocks are 8 cubes)."""
  cols = tables.cube_cols
  return jnp.pad(cols, ((0, 0), (0, round_up(cubes, 8) - cols.shape[1]), (0, 0)))


def _looped_calls(plan: TilePlan, tables: Tables, call, outputs):
  """Runs call(meta, nbr, nnb) -> per-call outputs [1, H, cc * T, X] for every (batch entry,
  block of cc query cubes) and writes them into `outputs` [B, H, Cp * T, X]."""
  cc = plan.cubes_per_call
  per_entry = -(-plan.cubes // cc)
  pad = per_entry * cc - plan.cubes
  nbr = jnp.pad(tables.neighbours, ((0, 0), (0, pad), (0, 0)))
  nnb = jnp.pad(tables.num_neighbours, ((0, 0), (0, pad)))      # padded cubes: no neighbours

  def one(i, outputs):
    b, c0 = i // per_entry, (i % per_entry) * cc
    table = jax.lax.dynamic_slice(nbr, (b, c0, 0), (1, cc, plan.k_max)).reshape(-1)
    counts = jax.lax.dynamic_slice(nnb, (b, c0), (1, cc)).reshape(-1)
    results = call(jnp.stack([b, c0]).astype(jnp.int32), table, counts)
    return tuple(jax.lax.dynamic_update_slice(out, r, (b, 0, c0 * plan.t, 0))
                 for out, r in zip(outputs, results))

  calls = plan.batch * per_entry
  outputs = (one(0, outputs) if calls == 1
             else jax.lax.fori_loop(0, calls, one, outputs))
  return tuple(out[:, :, :plan.cubes * plan.t] for out in outputs)


def _call(kernel, plan: TilePlan, grid, in_specs, out_specs, out_shape, scratch, interpret,
          name, semantics, prefetch, *args, takes_offset=False):
  """takes_offset: the last of `args` is the far offset, left out (with its spec) when None."""
  absent = ()
  if takes_offset and args[-1] is None:
    args, in_specs = args[:-1], in_specs[:-1]
    absent = (len(prefetch) + len(args),)
  return pl.pallas_call(
      tiles.absent_refs(functools.partial(kernel, plan=plan), absent),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      interpret=interpret,
      name=name,
  )(*prefetch, *args)


class _Specs:
  """BlockSpecs on the grid (h, a, j) with prefetched (meta, nbr, nnb); a is the cube's
  index within its call, meta[1] + a its index in the batch entry."""

  def __init__(self, plan: TilePlan):
    t, d, s, k_max, last = plan.t, plan.d, plan.s_block, plan.k_max, plan.cubes - 1
    own_cube = lambda meta, a: jnp.minimum(meta[1] + a, last)
    nbr_at = lambda a, j, nbr: nbr[a * k_max + jnp.minimum(j, k_max - 1)]
    summary = lambda j: jnp.maximum(j - k_max, 0)
    self.own = pl.BlockSpec((1, 1, t, d), lambda h, a, j, m, nbr, nnb: (m[0], h, own_cube(m, a), 0))
    self.own_rows = pl.BlockSpec((1, 1, t, 1),
                                 lambda h, a, j, m, nbr, nnb: (m[0], h, own_cube(m, a), 0))
    self.out = pl.BlockSpec((1, 1, t, d), lambda h, a, j, m, nbr, nnb: (0, h, a, 0))
    self.out_rows = pl.BlockSpec((1, 1, t, 1), lambda h, a, j, m, nbr, nnb: (0, h, a, 0))
    self.key = pl.BlockSpec((1, 1, t, d), lambda h, a, j, m, nbr, nnb: (m[0], h, nbr_at(a, j, nbr), 0))
    self.key_rows = pl.BlockSpec((1, 1, t, 1),
                                 lambda h, a, j, m, nbr, nnb: (m[0], h, nbr_at(a, j, nbr), 0))
    self.key_bias = pl.BlockSpec((1, 1, 1, t),
                                 lambda h, a, j, m, nbr, nnb: (m[0], nbr_at(a, j, nbr), 0, 0))
    self.own_key_bias = pl.BlockSpec((1, 1, 1, t),
                                     lambda h, a, j, m, nbr, nnb: (m[0], own_cube(m, a), 0, 0))
    self.summ = pl.BlockSpec((1, 1, s, d), lambda h, a, j, m, nbr, nnb: (m[0], h, summary(j), 0))
    self.rows = pl.BlockSpec((1, 8, s), lambda h, a, j, m, nbr, nnb: (m[0], 0, summary(j)))
    self.cols = pl.BlockSpec((1, 8, 8), lambda h, a, j, m, nbr, nnb: (m[0], _eighth(m[1] + a), 0))
    self.offset = pl.BlockSpec((1, 1, 1), lambda h, a, j, m, nbr, nnb: (h, 0, 0))


def _outputs(plan: TilePlan, *dtypes_widths):
  """Zero [B, H, Cp * T, X] buffers the looped calls write into, and per-call shapes."""
  cc = plan.cubes_per_call
  padded = -(-plan.cubes // cc) * cc
  full = tuple(jnp.zeros((plan.batch, plan.heads, padded * plan.t, w), dt)
               for dt, w in dtypes_widths)
  per_call = [jax.ShapeDtypeStruct((1, plan.heads, cc * plan.t, w), dt) for dt, w in dtypes_widths]
  return full, per_call


def forward(plan: TilePlan, _blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables):
  sp, cc = _Specs(plan), plan.cubes_per_call
  cols = _padded_cols(plan, tables, -(-plan.cubes // cc) * cc)
  full, per_call = _outputs(plan, (q.dtype, plan.d), (_F32, 1))

  def call(meta, nbr, nnb):
    return _call(_fwd_kernel, plan, (plan.heads, cc, plan.k_max + plan.summary_blocks),
                 [sp.own, sp.key, sp.key, sp.key_bias, sp.summ, sp.summ, sp.rows, sp.cols,
                  sp.offset],
                 [sp.out, sp.out_rows], per_call,
                 [pltpu.VMEM((plan.t, 1), _F32), pltpu.VMEM((plan.t, 1), _F32),
                  pltpu.VMEM((plan.t, plan.d), _F32)],
                 interpret, "pack3d_fwd", ("parallel", "parallel", "arbitrary"),
                 (meta, nbr, nnb), q, k, v, tables.key_bias, kbar, vbar, tables.cube_rows, cols,
                 offset, takes_offset=True)

  return _looped_calls(plan, tables, call, full)


def backward(plan: TilePlan, _blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables,
             do, lse, delta):
  """dq, dk, dv, dkbar, dvbar and, with a far offset, its per-summary parts [B, H, 1, Cs]."""
  sp, cc = _Specs(plan), plan.cubes_per_call
  cols = _padded_cols(plan, tables, -(-plan.cubes // cc) * cc)
  t, d = plan.t, plan.d
  full, per_call = _outputs(plan, (q.dtype, d))

  def dq_call(meta, nbr, nnb):
    return (_call(_dq_kernel, plan, (plan.heads, cc, plan.k_max + plan.summary_blocks),
                  [sp.own, sp.own, sp.own_rows, sp.own_rows, sp.key, sp.key, sp.key_bias,
                   sp.summ, sp.summ, sp.rows, sp.cols, sp.offset],
                  sp.out, per_call[0], [pltpu.VMEM((t, d), _F32)], interpret, "pack3d_bwd_dq",
                  ("parallel", "parallel", "arbitrary"), (meta, nbr, nnb), q, do, lse, delta,
                  k, v, tables.key_bias, kbar, vbar, tables.cube_rows, cols, offset,
                  takes_offset=True),)

  (dq,) = _looped_calls(plan, tables, dq_call, full)

  full, per_call = _outputs(plan, (k.dtype, d), (v.dtype, d))

  def dkv_call(meta, nbr, nnb):
    return _call(_dkv_kernel, plan, (plan.heads, cc, plan.k_max),
                 [sp.key, sp.key, sp.key_rows, sp.key_rows, sp.own, sp.own, sp.own_key_bias],
                 [sp.out, sp.out], per_call, [pltpu.VMEM((t, d), _F32)] * 2, interpret,
                 "pack3d_bwd_dkv", ("parallel", "parallel", "arbitrary"), (meta, nbr, nnb),
                 q, do, lse, delta, k, v, tables.key_bias)

  dk, dv = _looped_calls(plan, tables, dkv_call, full)

  # Summaries: grid (b, h, summary block s, query cube a).
  s = plan.s_block
  query = pl.BlockSpec((1, 1, t, d), lambda b, h, s, a: (b, h, a, 0))
  query_rows = pl.BlockSpec((1, 1, t, 1), lambda b, h, s, a: (b, h, a, 0))
  summ = pl.BlockSpec((1, 1, s, d), lambda b, h, s, a: (b, h, s, 0))
  rows = pl.BlockSpec((1, 8, s), lambda b, h, s, a: (b, 0, s))
  cols_spec = pl.BlockSpec((1, 8, 8), lambda b, h, s, a: (b, _eighth(a), 0))
  in_specs = [query, query, query_rows, query_rows, summ, summ, rows, cols_spec]
  args = [q, do, lse, delta, kbar, vbar, tables.cube_rows, _padded_cols(plan, tables, plan.cubes)]
  out_specs, scratch = [summ, summ], [pltpu.VMEM((s, d), _F32)] * 2
  out_shape = [jax.ShapeDtypeStruct(kbar.shape, kbar.dtype)] * 2
  absent = ()
  if plan.far_offset:  # beta_h in; per-summary sums of ds [1, S] out
    in_specs.append(pl.BlockSpec((1, 1, 1), lambda b, h, s, a: (h, 0, 0)))
    args.append(offset)
    out_specs.append(pl.BlockSpec((1, 1, 1, s), lambda b, h, s, a: (b, h, 0, s)))
    out_shape.append(jax.ShapeDtypeStruct((plan.batch, plan.heads, 1, plan.c_s), _F32))
    scratch.append(pltpu.VMEM((1, s), _F32))
  else:  # off_ref, doff_ref and doff_sc in the kernel's argument list
    absent = (8, 11, 14)
  summaries = pl.pallas_call(
      tiles.absent_refs(functools.partial(_dsummary_kernel, plan=plan), absent),
      grid=(plan.batch, plan.heads, plan.summary_blocks, plan.cubes),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="pack3d_bwd_dsummary",
  )(*args)
  return dq, dk, dv, *summaries
