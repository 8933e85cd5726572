"""Pack3D attention on TPU (Mosaic).

Forward, dq and dk/dv: `PrefetchScalarGridSpec` with the neighbour table in SMEM; grid
(query cube a, stream step j), j walking the K neighbour cubes then the summary blocks;
k/v `index_map`s read the table; VMEM scratch carries the softmax state. One program
serves every head of its cube: the operands keep the heads side by side on the lanes, g
slots per row (`tiles.lane_groups`: H*D = 96 fills 128-lane tiles four slots at a time, so
HBM holds no padding), a cube's [T/g, g*H*D] block restacked into its [T, H*D] tile in VMEM
(`_tile`, and `_store` the way back), each head a static lane slice, with its state in a
leading scratch axis; lse and delta come as [H, T] rows per cube (a head's column is
`expand_dims(row, -1)`, its row is written back through a diagonal mask). SMEM holds 1 MiB,
so the calls loop over (batch entry, block of `cubes_per_call` query cubes) and each
prefetches only its block's rows of the table (plus (b, first cube) as scalars).
The summary gradients run as one call on grid (b, summary block, query cube).
With a far offset, the forward, dq and summary kernels take the heads' betas as a [1, H]
block, and the summary kernel also writes per-summary sums of the far scores' gradient
(d beta); without one, neither operand nor output exists (`tiles.absent_refs`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from neurips26_jax.jaxops.tiling import round_up
from neurips26_jax.pallas_kernels.pack3d_attention import tiles
from neurips26_jax.pallas_kernels.pack3d_attention.tiles import Tables, TilePlan

_F32 = jnp.float32


def _eighth(cube):
  """cube // 8 for cube >= 0 (jnp's floor division lowers through sign, which asks for the
  TPU generation and so cannot lower from CPU)."""
  return jax.lax.div(cube, 8)


def _lanes(plan: TilePlan, h: int):
  """Head h's lanes of an [R, H*D] tile."""
  return slice(h * plan.d, (h + 1) * plan.d)


def _tile(plan: TilePlan, block):
  """A cube's [T/g, g*H*D] block -> its [T, H*D] tile: lane group j holds slots j T/g ..
  (j+1) T/g - 1 (`jaxops.pack3d_layout.group_rows`), stacked on the rows."""
  hd = plan.heads * plan.d
  return jnp.concatenate([block[:, j * hd:(j + 1) * hd] for j in range(plan.groups)], 0)


def _store(plan: TilePlan, ref, per_head):
  """Writes H float32 [T, D] tiles (head h's lanes of the cube's tile) to ref's [T/g, g*H*D]
  block: the inverse of `_tile`, the heads side by side within each lane group."""
  rows = plan.t // plan.groups
  ref[0] = jnp.concatenate([x[j * rows:(j + 1) * rows] for j in range(plan.groups)
                            for x in per_head], 1).astype(ref.dtype)


def _column(rows_ref, h: int):
  """Head h's row of a [1, 1, H, T] statistics block as a column [T, 1]."""
  return jnp.expand_dims(rows_ref[0, 0, h], -1)


def _rows(plan: TilePlan, columns):
  """[H, T] from H columns [T, 1] (a transpose through a diagonal mask and sums: elementwise
  ops and reductions only)."""
  t = columns[0].shape[0]
  eye = (jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
         == jax.lax.broadcasted_iota(jnp.int32, (t, t), 1))
  head = jax.lax.broadcasted_iota(jnp.int32, (plan.heads, t), 0)
  out = jnp.zeros((plan.heads, t), _F32)
  for h, col in enumerate(columns):
    row = jnp.sum(jnp.where(eye, col, 0.0), axis=0, keepdims=True)      # [1, T]
    out = jnp.where(head == h, row, out)
  return out


def _far(plan: TilePlan, cols_ref, rows_ref, cube, off_ref, h: int):
  """Far biases [1, S] of query cube `cube` (row cube % 8 of its 8-cube block of cube_cols),
  plus head h's far offset (off_ref None: none)."""
  offset = None
  if off_ref is not None and plan.offset_levels == 1:   # [1, H]
    offset = tiles.entry(off_ref[...], h)
  elif off_ref is not None:                             # [H, L]: head h's row
    offset = tiles.head_offsets(tiles.block_row(off_ref[...], h), plan.offset_levels)
  return tiles.far_bias(tiles.query_key(cols_ref[0], jax.lax.rem(cube, 8)), rows_ref[0],
                        plan.radii, plan.block_bias, offset)


# ----------------------------------------------------------------------------
# Kernels. Prefetched refs: meta = (b, first query cube of the call), nbr [cc * K], nnb [cc].
# off_ref (the heads' far offsets) and the summary kernel's doff_ref, doff_sc are None when
# the call has no far offset.
# ----------------------------------------------------------------------------

def _fwd_kernel(meta, nbr, nnb, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref, rows_ref,
                cols_ref, off_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, plan: TilePlan):
  a, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _():
    for h in range(plan.heads):
      m_sc[h], l_sc[h], acc_sc[h] = tiles.init_state(plan.t, plan.d)

  def update(k, v, bias):
    q = _tile(plan, q_ref[0])
    for h in range(plan.heads):
      lanes = _lanes(plan, h)
      m_sc[h], l_sc[h], acc_sc[h] = tiles.softmax_step(
          (m_sc[h], l_sc[h], acc_sc[h]), q[:, lanes], k[:, lanes], v[:, lanes], bias(h),
          plan.scale)

  pl.when(j < nnb[a])(lambda: update(_tile(plan, k_ref[0]), _tile(plan, v_ref[0]),
                                      lambda h: kb_ref[0, 0]))
  pl.when(j >= plan.k_max)(lambda: update(
      kbar_ref[0], vbar_ref[0], lambda h: _far(plan, cols_ref, rows_ref, meta[1] + a, off_ref, h)))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    o, lse = zip(*(tiles.finish(m_sc[h], l_sc[h], acc_sc[h]) for h in range(plan.heads)))
    _store(plan, o_ref, o)
    lse_ref[0, 0] = _rows(plan, lse)


def _dq_kernel(meta, nbr, nnb, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
               kbar_ref, vbar_ref, rows_ref, cols_ref, off_ref, dq_ref, dq_sc, *,
               plan: TilePlan):
  a, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def update(k, v, bias):
    q, do = _tile(plan, q_ref[0]), _tile(plan, do_ref[0])
    for h in range(plan.heads):
      lanes = _lanes(plan, h)
      dq_sc[h] += tiles.dq_step(q[:, lanes], k[:, lanes], v[:, lanes], bias(h), do[:, lanes],
                                _column(lse_ref, h), _column(delta_ref, h), plan.scale)

  pl.when(j < nnb[a])(lambda: update(_tile(plan, k_ref[0]), _tile(plan, v_ref[0]),
                                      lambda h: kb_ref[0, 0]))
  pl.when(j >= plan.k_max)(lambda: update(
      kbar_ref[0], vbar_ref[0], lambda h: _far(plan, cols_ref, rows_ref, meta[1] + a, off_ref, h)))

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    _store(plan, dq_ref, [dq_sc[h] for h in range(plan.heads)])


def _dkv_kernel(meta, nbr, nnb, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                dk_ref, dv_ref, dk_sc, dv_sc, *, plan: TilePlan):
  """Key cube a; step j visits query cube nbr[a, j] (the relation is symmetric)."""
  a, j = pl.program_id(0), pl.program_id(1)

  @pl.when(j == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  @pl.when(j < nnb[a])
  def _():
    q, do, k, v = (_tile(plan, r[0]) for r in (q_ref, do_ref, k_ref, v_ref))
    for h in range(plan.heads):
      lanes = _lanes(plan, h)
      dk, dv = tiles.dkv_step(q[:, lanes], k[:, lanes], v[:, lanes], kb_ref[0, 0], do[:, lanes],
                              _column(lse_ref, h), _column(delta_ref, h), plan.scale)
      dk_sc[h] += dk
      dv_sc[h] += dv

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    _store(plan, dk_ref, [dk_sc[h] for h in range(plan.heads)])
    _store(plan, dv_ref, [dv_sc[h] for h in range(plan.heads)])


def _dsummary_kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, rows_ref, cols_ref,
                     off_ref, dkbar_ref, dvbar_ref, doff_ref, dk_sc, dv_sc, doff_sc, *,
                     plan: TilePlan):
  """Summary block s; step a visits every query cube (the far bias masks the others)."""
  a = pl.program_id(2)

  @pl.when(a == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)
    if doff_sc is not None:
      doff_sc[...] = jnp.zeros_like(doff_sc)

  q, do, kbar, vbar = _tile(plan, q_ref[0]), _tile(plan, do_ref[0]), kbar_ref[0], vbar_ref[0]
  for h in range(plan.heads):
    lanes = _lanes(plan, h)
    tile = (q[:, lanes], kbar[:, lanes], vbar[:, lanes],
            _far(plan, cols_ref, rows_ref, a, off_ref, h), do[:, lanes], _column(lse_ref, h),
            _column(delta_ref, h), plan.scale)
    if doff_sc is None:
      dk, dv = tiles.dkv_step(*tile)
    else:
      dk, dv, ds_sum = tiles.dsummary_step(*tile)
      doff_sc[h] += ds_sum
    dk_sc[h] += dk
    dv_sc[h] += dv

  @pl.when(a == pl.num_programs(2) - 1)
  def _():
    dkbar_ref[0] = jnp.concatenate([dk_sc[h] for h in range(plan.heads)], 1).astype(
        dkbar_ref.dtype)
    dvbar_ref[0] = jnp.concatenate([dv_sc[h] for h in range(plan.heads)], 1).astype(
        dvbar_ref.dtype)
    if doff_ref is not None:
      head = jax.lax.broadcasted_iota(jnp.int32, doff_ref.shape[1:], 0)
      parts = jnp.zeros(doff_ref.shape[1:], _F32)
      for h in range(plan.heads):
        parts = jnp.where(head == h, doff_sc[h], parts)
      doff_ref[0] = parts


# ----------------------------------------------------------------------------
# Calls.
# ----------------------------------------------------------------------------

def _padded_cols(plan: TilePlan, tables: Tables, cubes: int):
  """cube_cols padded to a multiple of 8 rows covering `cubes` (its blocks are 8 cubes)."""
  cols = tables.cube_cols
  return jnp.pad(cols, ((0, 0), (0, round_up(cubes, 8) - cols.shape[1]), (0, 0)))


def _looped_calls(plan: TilePlan, tables: Tables, call, outputs):
  """Runs call(meta, nbr, nnb) -> per-call outputs (their axis 1 holding the call's cc cubes)
  for every (batch entry, block of cc query cubes) and writes them into `outputs` (axis 1:
  the padded cubes of the entry, `_outputs`)."""
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
    return tuple(jax.lax.dynamic_update_slice(
        out, r, (b, c0 * (r.shape[1] // cc)) + (0,) * (r.ndim - 2))
        for out, r in zip(outputs, results))

  calls = plan.batch * per_entry
  outputs = (one(0, outputs) if calls == 1
             else jax.lax.fori_loop(0, calls, one, outputs))
  return tuple(out[:, :out.shape[1] // (per_entry * cc) * plan.cubes] for out in outputs)


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
  """BlockSpecs on the grid (a, j) with prefetched (meta, nbr, nnb); a is the cube's index
  within its call, meta[1] + a its index in the batch entry. Token blocks [1, T/g, g*H*D],
  statistics [1, 1, H, T], summaries [1, S, H*D]."""

  def __init__(self, plan: TilePlan):
    t, hd, s, k_max, last = plan.t, plan.heads * plan.d, plan.s_block, plan.k_max, plan.cubes - 1
    tokens = _token_block(plan)
    own_cube = lambda meta, a: jnp.minimum(meta[1] + a, last)
    nbr_at = lambda a, j, nbr: nbr[a * k_max + jnp.minimum(j, k_max - 1)]
    summary = lambda j: jnp.maximum(j - k_max, 0)
    stats = (1, 1, plan.heads, t)
    self.own = pl.BlockSpec(tokens, lambda a, j, m, nbr, nnb: (m[0], own_cube(m, a), 0))
    self.own_rows = pl.BlockSpec(stats, lambda a, j, m, nbr, nnb: (m[0], own_cube(m, a), 0, 0))
    self.out = pl.BlockSpec(tokens, lambda a, j, m, nbr, nnb: (0, a, 0))
    self.out_rows = pl.BlockSpec(stats, lambda a, j, m, nbr, nnb: (0, a, 0, 0))
    self.key = pl.BlockSpec(tokens, lambda a, j, m, nbr, nnb: (m[0], nbr_at(a, j, nbr), 0))
    self.key_rows = pl.BlockSpec(stats,
                                 lambda a, j, m, nbr, nnb: (m[0], nbr_at(a, j, nbr), 0, 0))
    self.key_bias = pl.BlockSpec((1, 1, 1, t),
                                 lambda a, j, m, nbr, nnb: (m[0], nbr_at(a, j, nbr), 0, 0))
    self.own_key_bias = pl.BlockSpec((1, 1, 1, t),
                                     lambda a, j, m, nbr, nnb: (m[0], own_cube(m, a), 0, 0))
    self.summ = pl.BlockSpec((1, s, hd), lambda a, j, m, nbr, nnb: (m[0], summary(j), 0))
    self.rows = pl.BlockSpec((1, 8, s), lambda a, j, m, nbr, nnb: (m[0], 0, summary(j)))
    self.cols = pl.BlockSpec((1, 8, 8), lambda a, j, m, nbr, nnb: (m[0], _eighth(m[1] + a), 0))
    self.offset = pl.BlockSpec(_offset_shape(plan), lambda a, j, m, nbr, nnb: (0, 0))


def _token_block(plan: TilePlan):
  """A cube's block of a token operand: [1, T/g, g*H*D]."""
  return (1, plan.t // plan.groups, plan.groups * plan.heads * plan.d)


def _outputs(plan: TilePlan, *kinds):
  """Zero buffers the looped calls write into, and the per-call shapes: ("tokens", dtype)
  [B, Cp * T/g, g*H*D]; ("stats",) [B, Cp, H, T] float32 (Cp: C padded to the calls' cubes)."""
  cc = plan.cubes_per_call
  padded = -(-plan.cubes // cc) * cc
  _, rows, width = _token_block(plan)
  shape = lambda kind, cubes: ((cubes * rows, width) if kind[0] == "tokens"
                               else (cubes, plan.heads, plan.t))
  dtype = lambda kind: kind[1] if kind[0] == "tokens" else _F32
  full = tuple(jnp.zeros((plan.batch,) + shape(k, padded), dtype(k)) for k in kinds)
  per_call = [jax.ShapeDtypeStruct((1,) + shape(k, cc), dtype(k)) for k in kinds]
  return full, per_call


def _offset_shape(plan: TilePlan):
  """The far offsets' block: [1, H] (one per head), or [H, L] per level."""
  return (1, plan.heads) if plan.offset_levels == 1 else (plan.heads, plan.offset_levels)


def _offset_row(plan: TilePlan, offset):
  """The far offsets [H, 1, Lo] as the kernels' block (`_offset_shape`; None stays None)."""
  return None if offset is None else offset.reshape(_offset_shape(plan))


def forward(plan: TilePlan, _blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables):
  """o [B, C*T/g, g*H*D] and lse [B, C, H, T] (the layout of `tiles`)."""
  sp, cc = _Specs(plan), plan.cubes_per_call
  cols = _padded_cols(plan, tables, -(-plan.cubes // cc) * cc)
  full, per_call = _outputs(plan, ("tokens", q.dtype), ("stats",))
  h, t, d = plan.heads, plan.t, plan.d

  def call(meta, nbr, nnb):
    return _call(_fwd_kernel, plan, (cc, plan.k_max + plan.summary_blocks),
                 [sp.own, sp.key, sp.key, sp.key_bias, sp.summ, sp.summ, sp.rows, sp.cols,
                  sp.offset],
                 [sp.out, sp.out_rows], per_call,
                 [pltpu.VMEM((h, t, 1), _F32), pltpu.VMEM((h, t, 1), _F32),
                  pltpu.VMEM((h, t, d), _F32)],
                 interpret, "pack3d_fwd", ("parallel", "arbitrary"),
                 (meta, nbr, nnb), q, k, v, tables.key_bias, kbar, vbar, tables.cube_rows, cols,
                 _offset_row(plan, offset), takes_offset=True)

  return _looped_calls(plan, tables, call, full)


def backward(plan: TilePlan, _blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables,
             do, lse, delta):
  """dq, dk, dv, dkbar, dvbar and, with a far offset, its per-summary parts [B, H, Cs]."""
  sp, cc = _Specs(plan), plan.cubes_per_call
  cols = _padded_cols(plan, tables, -(-plan.cubes // cc) * cc)
  h, t, d, hd = plan.heads, plan.t, plan.d, plan.heads * plan.d
  offset = _offset_row(plan, offset)
  full, per_call = _outputs(plan, ("tokens", q.dtype))

  def dq_call(meta, nbr, nnb):
    return (_call(_dq_kernel, plan, (cc, plan.k_max + plan.summary_blocks),
                  [sp.own, sp.own, sp.own_rows, sp.own_rows, sp.key, sp.key, sp.key_bias,
                   sp.summ, sp.summ, sp.rows, sp.cols, sp.offset],
                  sp.out, per_call[0], [pltpu.VMEM((h, t, d), _F32)], interpret, "pack3d_bwd_dq",
                  ("parallel", "arbitrary"), (meta, nbr, nnb), q, do, lse, delta,
                  k, v, tables.key_bias, kbar, vbar, tables.cube_rows, cols, offset,
                  takes_offset=True),)

  (dq,) = _looped_calls(plan, tables, dq_call, full)

  full, per_call = _outputs(plan, ("tokens", k.dtype), ("tokens", v.dtype))

  def dkv_call(meta, nbr, nnb):
    return _call(_dkv_kernel, plan, (cc, plan.k_max),
                 [sp.key, sp.key, sp.key_rows, sp.key_rows, sp.own, sp.own, sp.own_key_bias],
                 [sp.out, sp.out], per_call, [pltpu.VMEM((h, t, d), _F32)] * 2, interpret,
                 "pack3d_bwd_dkv", ("parallel", "arbitrary"), (meta, nbr, nnb),
                 q, do, lse, delta, k, v, tables.key_bias)

  dk, dv = _looped_calls(plan, tables, dkv_call, full)

  # Summaries: grid (b, summary block s, query cube a).
  s = plan.s_block
  query = pl.BlockSpec(_token_block(plan), lambda b, s, a: (b, a, 0))
  query_rows = pl.BlockSpec((1, 1, h, t), lambda b, s, a: (b, a, 0, 0))
  summ = pl.BlockSpec((1, s, hd), lambda b, s, a: (b, s, 0))
  rows = pl.BlockSpec((1, 8, s), lambda b, s, a: (b, 0, s))
  cols_spec = pl.BlockSpec((1, 8, 8), lambda b, s, a: (b, _eighth(a), 0))
  in_specs = [query, query, query_rows, query_rows, summ, summ, rows, cols_spec]
  args = [q, do, lse, delta, kbar, vbar, tables.cube_rows, _padded_cols(plan, tables, plan.cubes)]
  out_specs, scratch = [summ, summ], [pltpu.VMEM((h, s, d), _F32)] * 2
  out_shape = [jax.ShapeDtypeStruct(kbar.shape, kbar.dtype)] * 2
  absent = ()
  if plan.far_offset:  # betas in; per-summary sums of ds [H, S] out
    in_specs.append(pl.BlockSpec(_offset_shape(plan), lambda b, s, a: (0, 0)))
    args.append(offset)
    out_specs.append(pl.BlockSpec((1, h, s), lambda b, s, a: (b, 0, s)))
    out_shape.append(jax.ShapeDtypeStruct((plan.batch, h, plan.c_s), _F32))
    scratch.append(pltpu.VMEM((h, 1, s), _F32))
  else:  # off_ref, doff_ref and doff_sc in the kernel's argument list
    absent = (8, 11, 14)
  summaries = pl.pallas_call(
      tiles.absent_refs(functools.partial(_dsummary_kernel, plan=plan), absent),
      grid=(plan.batch, plan.summary_blocks, plan.cubes),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="pack3d_bwd_dsummary",
  )(*args)
  return dq, dk, dv, *summaries
