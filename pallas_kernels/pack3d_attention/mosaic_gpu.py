"""Pack3D attention on Hopper GPUs (Mosaic GPU, jax >= 0.11.2): TMA loads into shared
memory, WGMMA matmuls with float32 accumulators in registers, one warpgroup per block.

A query cube's T = 64 slots are WGMMA's M rows (one warpgroup), so this body serves cubes of
33 to 64 tokens (T = 64 slots, e.g. 4x4x4) and D <= 256 (`unsupported`); the op keeps
the others on Triton.
Head h of a slot row is the lane slice [h*D, (h+1)*D) of the shared layout (`tiles`): the
kernels see [B, C*T, H, d] views of it (a reshape, free) and TMA one head's [T, d] tile. D is
WGMMA's contraction axis for q k^T, so it is padded with zeros to d, a multiple of 16, in
HBM only when D is not one already (D = 24: d = 32).

Kernels, on the Triton kernels' decomposition (`triton.py`), grids (cube or summary block,
head, batch entry):
  forward   one online softmax per query cube over its neighbour cubes' tokens, then the
            summary blocks [S, d] with their far biases (`tiles.far_bias_of`);
  dq        the same two streams, accumulating dq = sum ds K / sqrt(D);
  dK, dV    per key cube over the query cubes that have it as a neighbour (the relation is
            symmetric), with transposed tiles: s^T = K q^T [T, T];
  summaries per block of S summaries over every query cube: dKbar, dVbar and (with a far
            offset) the per-summary sums of ds, d beta's parts.
Each program loads its own tiles once; the loops stream the others in through
`plgpu.emit_pipeline` (`_Streams`: `num_stages` steps in flight, the next neighbour's or
summary block's tiles loading while this step's matmuls run; the neighbour index of a step is
read from the table in gmem by the block spec). WGMMA reads A and B from shared memory (the
scores' probabilities and gradients are written there in the input dtype), which is what the
Mosaic GPU interpreter runs. Softmax statistics are vectors in WGMMA's row or column layout
(`_layouts`), broadcast over the tile.

float32 runs here in the interpreter only (the dispatcher compiles 16-bit inputs only:
`dispatch.mosaic_gpu_dtype_ok`); TF32 WGMMA would want K-major B tiles the 16-bit path
does not need.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from neurips26_jax.jaxops.pack3d import MASK
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_module
from neurips26_jax.pallas_kernels.mosaic_gpu_common import (compiler_params, interpret_params,
                                                            products, smem_transforms,
                                                            store_operands)
from neurips26_jax.pallas_kernels.pack3d_attention import tiles
from neurips26_jax.pallas_kernels.pack3d_attention.tiles import Tables, TilePlan

_F32 = jnp.float32
SLOTS = 64  # slots per cube this body serves: one warpgroup's WGMMA M


def unsupported(slots_per_cube: int, block_shape, head_dim: int, block_summaries) -> str | None:
  """Why this body cannot serve a call (None: it can): a cube's slots are one WGMMA tile of
  query rows (64), D padded to 16 is WGMMA's N for p V (at most 256), and the summary kernel's
  blocks of summaries are WGMMA's M (a multiple of 64)."""
  if slots_per_cube != SLOTS:
    return (f"needs `block_shape` of 33 to {SLOTS} tokens (one WGMMA tile of query rows per "
            f"cube), got {tuple(block_shape)}")
  if -(-head_dim // 16) * 16 > 256:
    return f"needs the head width D (the last dim of `q`) <= 256, got {head_dim}"
  if block_summaries is not None and block_summaries % 64:
    return f"needs `block_summaries` a multiple of 64, got {block_summaries}"
  return None


def _layouts(plgpu):
  """(rows, cols): layouts of a per-row [M] and a per-column [N] vector of an [M, N]
  WGMMA tile."""
  return plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)


def _bcast(x, shape, dim: int):
  """A vector along `dim` of `shape`, broadcast over the other dim."""
  return lax.broadcast_in_dim(x, shape, [dim])


def _heads(plan: TilePlan, x):
  """[B, R, H*D] -> [B, R, H, d] (D zero-padded to d)."""
  x = x.reshape(x.shape[0], x.shape[1], plan.heads, plan.head_dim)
  if plan.d == plan.head_dim:
    return x
  return jnp.pad(x, ((0, 0),) * 3 + ((0, plan.d - plan.head_dim),))


def _lanes(plan: TilePlan, x):
  """Inverse of `_heads`: [B, R, H, d] -> [B, R, H*D]."""
  return x[..., :plan.head_dim].reshape(x.shape[0], x.shape[1], -1)


def _tile(ref, b, index, size, h):
  """Head h's [size, d] tile of rows [index*size, (index+1)*size) of batch entry b."""
  return ref.at[b, pl.ds(index * size, size), h]


def _load(plgpu, copies, bar):
  """Copies (gmem view, smem buffer) pairs in, each on its own barrier, and waits."""
  for j, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst, bar.at[j])
  for j in range(len(copies)):
    plgpu.barrier_wait(bar.at[j])


@dataclasses.dataclass(frozen=True)
class _Streams:
  """The tile streams of one program (batch entry b, head h): loops whose steps' tiles come
  in through `plgpu.emit_pipeline`, `stages` steps in flight (the next tiles load while this
  step's matmuls run). A stream is a list of (gmem view, block spec) pairs; `index(j)` is the
  cube (or summary block) of step j."""

  plgpu: Any
  plan: TilePlan
  stages: int
  transforms: tuple
  b: Any
  h: Any

  def _tiles(self, rows: int, index):
    return self.plgpu.BlockSpec((rows, self.plan.d), lambda j: (index(j), 0),
                                transforms=self.transforms)

  def _row(self, index):
    return self.plgpu.BlockSpec((None, self.plan.t), lambda j: (index(j), 0))

  def keys(self, k_ref, v_ref, kb_ref, index):
    """Cube index(j)'s k, v tiles [T, d] and key-slot bias [T]."""
    b, h, t = self.b, self.h, self.plan.t
    return [(k_ref.at[b, :, h], self._tiles(t, index)), (v_ref.at[b, :, h], self._tiles(t, index)),
            (kb_ref.at[b], self._row(index))]

  def summaries(self, kbar_ref, vbar_ref, rows_ref):
    """Summary block j's kbar, vbar tiles [S, d] and cube rows [8, S]."""
    b, h, s = self.b, self.h, self.plan.s_block
    block = lambda j: j
    return [(kbar_ref.at[b, :, h], self._tiles(s, block)),
            (vbar_ref.at[b, :, h], self._tiles(s, block)),
            (rows_ref.at[b], self.plgpu.BlockSpec((8, s), lambda j: (0, j)))]

  def queries(self, q_ref, do_ref, lse_ref, delta_ref, index):
    """Cube index(j)'s q, do tiles [T, d] and lse, delta [T]."""
    b, h, t = self.b, self.h, self.plan.t
    return [(q_ref.at[b, :, h], self._tiles(t, index)), (do_ref.at[b, :, h], self._tiles(t, index)),
            (lse_ref.at[b, :, h], self._row(index)), (delta_ref.at[b, :, h], self._row(index))]

  def loop(self, count, stream, body, init):
    """carry after body(j, *step j's smem tiles, carry) for j < count (count may be traced)."""
    return self.plgpu.emit_pipeline(
        lambda idx, *refs: body(idx[0], *refs), grid=(count,),
        in_specs=[spec for _, spec in stream], max_concurrent_steps=self.stages,
        init_carry=init)(*(ref for ref, _ in stream))


def _query_key(cols_ref, b, a):
  """(field, cz, cy, cx) of query cube a, scalars read from gmem."""
  return tuple(cols_ref[b, a, j] for j in range(4))


def _far_bias(plgpu, plan: TilePlan, rows_s, key, offset, layout):
  """Far biases [S] of the summaries whose (field, cz, cy, cx, count[, level]) rows are in
  rows_s [8, S], for the query cube `key`, as a vector in `layout` (the level row only with
  levels >= 2)."""
  used = 5 if len(plan.radii) == 1 else 6
  rows = [plgpu.load(rows_s.at[i], layout=layout) for i in range(used)]
  return tiles.far_bias_of(key, rows, plan.radii, plan.block_bias, offset)


def _offset(plan: TilePlan, off_ref, h):
  """Head h's far offset (per level: a tuple of them), scalars read from gmem, or None."""
  if off_ref is None:
    return None
  if plan.offset_levels == 1:
    return off_ref[h]
  return tuple(off_ref[h, k] for k in range(plan.offset_levels))


def _online_step(plgpu, plan: TilePlan, carry, q_s, k_s, v_s, p_s, bias):
  """One key tile of the online softmax (`tiles.softmax_step`): carry (acc [T, d], m [T],
  l [T]) -> updated carry; bias [N] per key."""
  acc, m, l = carry
  (s,) = products(plgpu, p_s.shape, [(q_s, k_s.transpose((1, 0)))])
  s = s * plan.scale + _bcast(bias, s.shape, 1)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - _bcast(m_new, s.shape, 0))
  l = alpha * l + jnp.sum(p, axis=1)
  store_operands(plgpu, [(p_s, p)])
  (pv,) = products(plgpu, acc.shape, [(p_s, v_s)])
  return acc * _bcast(alpha, acc.shape, 0) + pv, m_new, l


def _zeros(plgpu, shape, layout=None):
  return plgpu.layout_cast(jnp.zeros(shape, _F32), layout or plgpu.Layout.WGMMA)


def _call(plgpu, kernel, plan: TilePlan, grid, out_type, scratch, interpret, name, *args):
  """plgpu.kernel over grid (cube or summary block, head, batch entry); a None operand (no
  far offset) reaches the kernel as a None ref."""
  body = tiles.absent_refs(kernel, [i for i, x in enumerate(args) if x is None])
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=("a", "h", "b"),
      compiler_params=compiler_params(plgpu), interpret=interpret_params(plgpu, interpret),
      kernel_name=name,
  )(*(x for x in args if x is not None))


def _grid_ids():
  return tuple(lax.axis_index(n) for n in ("a", "h", "b"))


def _operands(plan: TilePlan, offset, tables: Tables, *xs):
  """Token and summary operands as [B, R, H, d] views; the tables as the kernels read them:
  key_bias [B, C, T], offset [H] (per level [H, L]) or None."""
  key_bias = tables.key_bias.reshape(plan.batch, plan.cubes, plan.t)
  if offset is not None:
    offset = offset.reshape((plan.heads,) if plan.offset_levels == 1
                            else (plan.heads, plan.offset_levels))
  return [_heads(plan, x) for x in xs], key_bias, offset


def forward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables):
  """o [B, C*T, H*D] and lse [B, C, H, T] from the shared layout (`tiles`)."""
  plgpu = mosaic_gpu_module()
  t, s, d, dtype = plan.t, plan.s_block, plan.d, q.dtype
  (q, k, v, kbar, vbar), key_bias, offset = _operands(plan, offset, tables, q, k, v, kbar, vbar)
  tf = smem_transforms(plgpu, dtype, d, t, s)
  rows_l, cols_l = _layouts(plgpu)

  def kernel(nbr_ref, nnb_ref, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref, rows_ref,
             cols_ref, off_ref, o_ref, lse_ref, q_s, p_s, pf_s, lse_s, bar):
    a, h, b = _grid_ids()
    streams = _Streams(plgpu, plan, blocks.num_stages, tf, b, h)
    _load(plgpu, [(_tile(q_ref, b, a, t, h), q_s)], bar)
    key, beta = _query_key(cols_ref, b, a), _offset(plan, off_ref, h)

    def local(_, k_s, v_s, kb_s, carry):
      bias = plgpu.load(kb_s, layout=cols_l)
      return _online_step(plgpu, plan, carry, q_s, k_s, v_s, p_s, bias)

    def far(_, kbar_s, vbar_s, rows_s, carry):
      bias = _far_bias(plgpu, plan, rows_s, key, beta, cols_l)
      return _online_step(plgpu, plan, carry, q_s, kbar_s, vbar_s, pf_s, bias)

    init = (_zeros(plgpu, (t, d)), plgpu.layout_cast(jnp.full((t,), MASK, _F32), rows_l),
            _zeros(plgpu, (t,), rows_l))
    neighbours = streams.keys(k_ref, v_ref, kb_ref, lambda j: nbr_ref[b, a, j])
    carry = streams.loop(nnb_ref[b, a], neighbours, local, init)
    acc, m, l = streams.loop(plan.summary_blocks, streams.summaries(kbar_ref, vbar_ref, rows_ref),
                             far, carry)
    q_s[...] = (acc / _bcast(l, acc.shape, 0)).astype(dtype)  # every WGMMA reading q is done
    lse_s[...] = m + jnp.log(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, _tile(o_ref, b, a, t, h))
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, a, h])
    plgpu.wait_smem_to_gmem(0)

  scratch = [plgpu.SMEM((t, d), dtype, transforms=tf), plgpu.SMEM((t, t), dtype, transforms=tf),
             plgpu.SMEM((t, s), dtype, transforms=tf), plgpu.SMEM((t,), _F32),
             plgpu.Barrier(num_barriers=1)]
  out_type = [jax.ShapeDtypeStruct(q.shape, dtype),
              jax.ShapeDtypeStruct((plan.batch, plan.cubes, plan.heads, t), _F32)]
  o, lse = _call(plgpu, kernel, plan, (plan.cubes, plan.heads, plan.batch), out_type, scratch,
                 interpret, "pack3d_fwd", tables.neighbours, tables.num_neighbours, q, k, v,
                 key_bias, kbar, vbar, tables.cube_rows, tables.cube_cols, offset)
  return _lanes(plan, o), lse


def backward(plan: TilePlan, blocks, interpret, q, k, v, kbar, vbar, offset, tables: Tables,
             do, lse, delta):
  """dq, dk, dv, dkbar, dvbar in the shared layout and, with a far offset, its per-summary
  parts [B, H, Cs]."""
  plgpu = mosaic_gpu_module()
  xs, key_bias, offset = _operands(plan, offset, tables, q, k, v, kbar, vbar, do)
  stages = blocks.num_stages
  dq = _dq(plgpu, plan, stages, interpret, xs, key_bias, offset, tables, lse, delta)
  dk, dv = _dkv(plgpu, plan, stages, interpret, xs, key_bias, tables, lse, delta)
  summaries = _dsummaries(plgpu, plan, stages, interpret, xs, offset, tables, lse, delta)
  return (*(_lanes(plan, g) for g in (dq, dk, dv, *summaries[:2])), *summaries[2:])


def _dq(plgpu, plan: TilePlan, stages, interpret, xs, key_bias, offset, tables: Tables, lse,
        delta):
  """dq [B, C*T, H, d]: per query cube over its two key streams."""
  q, k, v, kbar, vbar, do = xs
  t, s, d, dtype = plan.t, plan.s_block, plan.d, q.dtype
  tf = smem_transforms(plgpu, dtype, d, t, s)
  rows_l, cols_l = _layouts(plgpu)

  def kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
             kbar_ref, vbar_ref, rows_ref, cols_ref, off_ref, dq_ref, q_s, do_s, lse_s,
             delta_s, ds_s, dsf_s, bar):
    a, h, b = _grid_ids()
    streams = _Streams(plgpu, plan, stages, tf, b, h)
    _load(plgpu, [(_tile(q_ref, b, a, t, h), q_s), (_tile(do_ref, b, a, t, h), do_s),
                  (lse_ref.at[b, a, h], lse_s), (delta_ref.at[b, a, h], delta_s)], bar)
    lse_r, delta_r = (plgpu.load(x, layout=rows_l) for x in (lse_s, delta_s))
    key, beta = _query_key(cols_ref, b, a), _offset(plan, off_ref, h)

    def step(dq, k_tile, v_tile, ds_buf, bias):
      """dq + ds K for one key tile (`tiles.dq_step`, the scale applied at the end)."""
      shape = ds_buf.shape
      sc, dpv = products(plgpu, shape, [(q_s, k_tile.transpose((1, 0))),
                                         (do_s, v_tile.transpose((1, 0)))])
      p = jnp.exp(sc * plan.scale + _bcast(bias, shape, 1) - _bcast(lse_r, shape, 0))
      store_operands(plgpu, [(ds_buf, p * (dpv - _bcast(delta_r, shape, 0)))])
      return dq + products(plgpu, dq.shape, [(ds_buf, k_tile)])[0]

    def local(_, k_s, v_s, kb_s, dq):
      return step(dq, k_s, v_s, ds_s, plgpu.load(kb_s, layout=cols_l))

    def far(_, kbar_s, vbar_s, rows_s, dq):
      return step(dq, kbar_s, vbar_s, dsf_s, _far_bias(plgpu, plan, rows_s, key, beta, cols_l))

    neighbours = streams.keys(k_ref, v_ref, kb_ref, lambda j: nbr_ref[b, a, j])
    dq = streams.loop(nnb_ref[b, a], neighbours, local, _zeros(plgpu, (t, d)))
    dq = streams.loop(plan.summary_blocks, streams.summaries(kbar_ref, vbar_ref, rows_ref), far,
                      dq)
    q_s[...] = (dq * plan.scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, _tile(dq_ref, b, a, t, h))
    plgpu.wait_smem_to_gmem(0)

  tile = lambda: plgpu.SMEM((t, d), dtype, transforms=tf)
  vec = lambda: plgpu.SMEM((t,), _F32)
  scratch = [tile(), tile(), vec(), vec(), plgpu.SMEM((t, t), dtype, transforms=tf),
             plgpu.SMEM((t, s), dtype, transforms=tf), plgpu.Barrier(num_barriers=4)]
  return _call(plgpu, kernel, plan, (plan.cubes, plan.heads, plan.batch),
               jax.ShapeDtypeStruct(q.shape, dtype), scratch, interpret, "pack3d_bwd_dq",
               tables.neighbours, tables.num_neighbours, q, do, lse, delta, k, v, key_bias,
               kbar, vbar, tables.cube_rows, tables.cube_cols, offset)


def _transposed_grads(plgpu, plan: TilePlan, carry, k_s, v_s, q_s, do_s, p_s, ds_s, bias,
                      lse_s, delta_s):
  """(dK, dV) or (dK, dV, ds column sums) + one query tile's part, from transposed tiles:
  s^T = K q^T [M, T] with bias [M] per key row; lse, delta [T] per column
  (`tiles.dkv_step`, `tiles.dsummary_step`; dK's scale applied at the end)."""
  shape = p_s.shape
  _, cols_l = _layouts(plgpu)
  lse_c, delta_c = (plgpu.load(x, layout=cols_l) for x in (lse_s, delta_s))
  st, dpt = products(plgpu, shape, [(k_s, q_s.transpose((1, 0))),
                                     (v_s, do_s.transpose((1, 0)))])
  p = jnp.exp(st * plan.scale + _bcast(bias, shape, 0) - _bcast(lse_c, shape, 1))
  ds = p * (dpt - _bcast(delta_c, shape, 1))
  store_operands(plgpu, [(p_s, p), (ds_s, ds)])
  dk, dv = products(plgpu, carry[0].shape, [(ds_s, q_s), (p_s, do_s)])
  return (carry[0] + dk, carry[1] + dv) + tuple(c + jnp.sum(ds, axis=1) for c in carry[2:])


def _store_grads(plgpu, pairs):
  """Writes (value, smem buffer, gmem view) triples out."""
  for value, buf, _ in pairs:
    buf[...] = value.astype(buf.dtype)
  plgpu.commit_smem()
  for _, buf, dst in pairs:
    plgpu.copy_smem_to_gmem(buf, dst)
  plgpu.wait_smem_to_gmem(0)


def _dkv(plgpu, plan: TilePlan, stages, interpret, xs, key_bias, tables: Tables, lse, delta):
  """dK, dV [B, C*T, H, d]: per key cube over the query cubes that have it as a
  neighbour."""
  q, k, v, _, _, do = xs
  t, d, dtype = plan.t, plan.d, q.dtype
  tf = smem_transforms(plgpu, dtype, d, t)
  rows_l, _ = _layouts(plgpu)

  def kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
             dk_ref, dv_ref, k_s, v_s, kb_s, p_s, ds_s, bar):
    c, h, b = _grid_ids()
    streams = _Streams(plgpu, plan, stages, tf, b, h)
    _load(plgpu, [(_tile(k_ref, b, c, t, h), k_s), (_tile(v_ref, b, c, t, h), v_s),
                  (kb_ref.at[b, c], kb_s)], bar)
    bias = plgpu.load(kb_s, layout=rows_l)

    def step(_, q_s, do_s, lse_s, delta_s, carry):
      return _transposed_grads(plgpu, plan, carry, k_s, v_s, q_s, do_s, p_s, ds_s, bias, lse_s,
                               delta_s)

    queries = streams.queries(q_ref, do_ref, lse_ref, delta_ref, lambda j: nbr_ref[b, c, j])
    dk, dv = streams.loop(nnb_ref[b, c], queries, step, (_zeros(plgpu, (t, d)),) * 2)
    _store_grads(plgpu, [(dk * plan.scale, k_s, _tile(dk_ref, b, c, t, h)),
                         (dv, v_s, _tile(dv_ref, b, c, t, h))])

  tile = lambda: plgpu.SMEM((t, d), dtype, transforms=tf)
  square = lambda: plgpu.SMEM((t, t), dtype, transforms=tf)
  scratch = [tile(), tile(), plgpu.SMEM((t,), _F32), square(), square(),
             plgpu.Barrier(num_barriers=3)]
  out = jax.ShapeDtypeStruct(k.shape, dtype)
  return _call(plgpu, kernel, plan, (plan.cubes, plan.heads, plan.batch), [out, out], scratch,
               interpret, "pack3d_bwd_dkv", tables.neighbours, tables.num_neighbours, q, do,
               lse, delta, k, v, key_bias)


def _dsummaries(plgpu, plan: TilePlan, stages, interpret, xs, offset, tables: Tables, lse,
                delta):
  """dKbar, dVbar [B, Cs, H, d] and, with a far offset, d beta's per-summary parts
  [B, H, Cs]: per block of S summaries over every query cube."""
  q, _, _, kbar, vbar, do = xs
  t, s, d, dtype = plan.t, plan.s_block, plan.d, q.dtype
  tf = smem_transforms(plgpu, dtype, d, t, s)
  rows_l, _ = _layouts(plgpu)
  with_offset = offset is not None

  def kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, rows_ref, cols_ref,
             off_ref, dkbar_ref, dvbar_ref, *rest):
    doff_ref, rest = (rest[0], rest[1:]) if with_offset else (None, rest)
    kbar_s, vbar_s, rows_s, p_s, ds_s, bar, *doff_s = rest
    i, h, b = _grid_ids()
    streams = _Streams(plgpu, plan, stages, tf, b, h)
    _load(plgpu, [(_tile(kbar_ref, b, i, s, h), kbar_s), (_tile(vbar_ref, b, i, s, h), vbar_s),
                  (rows_ref.at[b, :, pl.ds(i * s, s)], rows_s)], bar)
    beta = _offset(plan, off_ref, h)

    def step(a, q_s, do_s, lse_s, delta_s, carry):
      bias = _far_bias(plgpu, plan, rows_s, _query_key(cols_ref, b, a), beta, rows_l)
      return _transposed_grads(plgpu, plan, carry, kbar_s, vbar_s, q_s, do_s, p_s, ds_s, bias,
                               lse_s, delta_s)

    init = (_zeros(plgpu, (s, d)),) * 2 + ((_zeros(plgpu, (s,), rows_l),) if with_offset else ())
    queries = streams.queries(q_ref, do_ref, lse_ref, delta_ref, lambda j: j)
    sums = streams.loop(plan.cubes, queries, step, init)
    out = [(sums[0] * plan.scale, kbar_s, _tile(dkbar_ref, b, i, s, h)),
           (sums[1], vbar_s, _tile(dvbar_ref, b, i, s, h))]
    if with_offset:
      out.append((sums[2], doff_s[0], doff_ref.at[b, h, pl.ds(i * s, s)]))
    _store_grads(plgpu, out)

  tile = lambda: plgpu.SMEM((s, d), dtype, transforms=tf)
  scratch = [tile(), tile(), plgpu.SMEM((8, s), _F32), plgpu.SMEM((s, t), dtype, transforms=tf),
             plgpu.SMEM((s, t), dtype, transforms=tf), plgpu.Barrier(num_barriers=3)]
  scratch += [plgpu.SMEM((s,), _F32)] if with_offset else []
  out_type = [jax.ShapeDtypeStruct(kbar.shape, dtype)] * 2
  if with_offset:
    out_type.append(jax.ShapeDtypeStruct((plan.batch, plan.heads, plan.c_s), _F32))
  return _call(plgpu, kernel, plan, (plan.summary_blocks, plan.heads, plan.batch), out_type,
               scratch, interpret, "pack3d_bwd_dsummary", q, do, lse, delta, kbar, vbar,
               tables.cube_rows, tables.cube_cols, offset)
