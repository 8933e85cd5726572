"""Pack3D attention as Pallas kernels, forward and backward.

Math and shapes: `jaxops.pack3d` (the reference this kernel is tested against). Tokens
are scattered into the cube-major layout of `jaxops.pack3d.cube_layout` (a cube is a
contiguous slab of T slots, empty slots masked), the summaries kbar, vbar are
precomputed in XLA (`cube_summaries`), and one program per (batch, head, query cube a)
runs ONE online softmax over two key streams (MASK = -1e30, a finite -inf)::

  m, l, acc = MASK, 0, 0                            # [T, 1], [T, 1], [T, D] float32
  for c in neighbours(a):  s = q K_c^T / sqrt(D) + mask_c      (<= (2r+1)^3 cubes)
  for summary block S:     s = q Kbar_S^T / sqrt(D) + bias[a, S]  (log n_b on far cubes)
      m' = max(m, rowmax s) ; l = e^{m-m'} l + rowsum e^{s-m'} ; acc = e^{m-m'} acc + e^{s-m'} V
  o = acc / l ;  lse = m + log l                    (lse saved for the backward)

Backward (FlashAttention-2 style, recomputing p = e^{s - lse}, delta = rowsum(do * o)):
  dq kernel over query cubes:        dq = sum_streams (p (do V^T - delta)) K / sqrt(D)
  dk/dv kernel over key cubes c:     loops over the query cubes a with c in neighbours(a)
                                     (the relation is symmetric, so that is neighbours(c))
  summary kernel over summary blocks: loops over all query cubes for dKbar, dVbar.
The summaries' gradients reach the tokens through the (autodiff) VJP of the cube mean,
i.e. scattered back by 1/n_b.

Two lowerings of the same tile math:
- Mosaic (TPU): `PrefetchScalarGridSpec` with the neighbour table in SMEM; the key
  streams are the trailing "arbitrary" grid axis (neighbours first, then summary blocks),
  k/v `index_map`s read the table; a VMEM accumulator carries the softmax state.
- Triton (GPU): grid steps cannot carry state, so each program loops (`fori_loop`) over
  its neighbours, loading `k_ref[pl.ds(pl.multiple_of(c * T, T), T), :]` from k/v passed
  whole, then over summary blocks. Triton needs power-of-two blocks: D is zero-padded.

`pack3d_attention` is the one public entry point; it dispatches with
`pallas_kernels.dispatch` (Mosaic on TPU, Triton on GPU, interpret mode on CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxops.pack3d import MASK, check_pack3d_inputs, cube_layout, cube_summaries
from jaxops.tiling import dot, dot_nt, dot_tn, next_pow2, round_up
from pallas_kernels.dispatch import Backend, KernelConfig, dispatch

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """`block_summaries`: cube summaries per step of the far stream (an upper bound).

  The token tile is always one cube (its slot count rounded up to a power of two >= 16).
  """

  block_summaries: int = 128

  @classmethod
  def for_backend(cls, backend: Backend, dtype=None) -> "BlockSizes":
    return cls(block_summaries=64) if backend == "triton" else cls()


# ----------------------------------------------------------------------------
# Tile math shared by every kernel and both lowerings. q, do [T, D]; k, v [Tk, D];
# bias [1, Tk] (0 or log n_b for keys, MASK for masked ones); lse, delta [T, 1].
# ----------------------------------------------------------------------------

def _scores(q, k, bias, scale):
  return dot_nt(q, k) * scale + bias


def _softmax_step(carry, q, k, v, bias, scale):
  """One key tile of the online softmax: carry (m, l, acc) -> updated carry."""
  m, l, acc = carry
  s = _scores(q, k, bias, scale)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
  alpha, p = jnp.exp(m - m_new), jnp.exp(s - m_new)
  return (m_new, alpha * l + jnp.sum(p, axis=1, keepdims=True),
          alpha * acc + dot(p.astype(v.dtype), v))


def _init_state(t, d):
  return (jnp.full((t, 1), MASK, _F32), jnp.zeros((t, 1), _F32), jnp.zeros((t, d), _F32))


def _finish(m, l, acc):
  return acc / l, m + jnp.log(l)


def _probs_and_dscores(q, k, v, bias, do, lse, delta, scale):
  """p = e^{s - lse} and ds = p (do v^T - delta), both [T, Tk] float32."""
  p = jnp.exp(_scores(q, k, bias, scale) - lse)
  return p, p * (dot_nt(do, v) - delta)


def _dq_step(q, k, v, bias, do, lse, delta, scale):
  _, ds = _probs_and_dscores(q, k, v, bias, do, lse, delta, scale)
  return dot(ds.astype(k.dtype), k) * scale


def _dkv_step(q, k, v, bias, do, lse, delta, scale):
  p, ds = _probs_and_dscores(q, k, v, bias, do, lse, delta, scale)
  return dot_tn(ds.astype(q.dtype), q) * scale, dot_tn(p.astype(do.dtype), do)


# ----------------------------------------------------------------------------
# Operands. Per batch entry b and head h, tokens in the cube-major layout:
#   q, k, v, o, do [B, H, C*T, D]; lse, delta [B, H, C*T, 1] float32
#   kbar, vbar [B, H, Cs, D] (Cs: C padded to a multiple of the summary block S)
#   key_bias [B, C, 1, T]; far_bias [B, C, 1, Cs] (float32: 0 / log n_b / MASK)
#   neighbours [B, C, K] int32, num_neighbours [B, C] int32 (see CubeLayout)
# ----------------------------------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["key_bias", "far_bias", "neighbours", "num_neighbours"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _Tables:
  key_bias: jax.Array
  far_bias: jax.Array
  neighbours: jax.Array
  num_neighbours: jax.Array


@dataclasses.dataclass(frozen=True)
class _Shape:
  """Static sizes of one call: B, H, C cubes, T slots per cube, D, K, S, Cs."""

  batch: int
  heads: int
  cubes: int
  t: int
  d: int
  k_max: int
  s_block: int
  c_s: int
  scale: float

  @property
  def summary_blocks(self) -> int:
    return self.c_s // self.s_block


def _f32_rows(shape: _Shape):
  return jax.ShapeDtypeStruct((shape.batch, shape.heads, shape.cubes * shape.t, 1), _F32)


# ----------------------------------------------------------------------------
# Mosaic (TPU): grid (B, H, query cube a, stream step j); j walks the K neighbour cubes,
# then the summary blocks. index_maps read the scalar-prefetched tables
# nbr [B*C*K] and nnb [B*C].
# ----------------------------------------------------------------------------

def _mosaic_query_specs(shape: _Shape, num_q_inputs: int):
  """BlockSpecs of (query-side inputs..., k, v, key_bias, kbar, vbar, far_bias)."""
  cubes, k_max, t, d, s = shape.cubes, shape.k_max, shape.t, shape.d, shape.s_block

  def nbr_at(b, a, j, nbr):
    return nbr[(b * cubes + a) * k_max + jnp.minimum(j, k_max - 1)]

  summary = lambda j: jnp.maximum(j - k_max, 0)
  own = pl.BlockSpec((1, 1, t, d), lambda b, h, a, j, nbr, nnb: (b, h, a, 0))
  own_rows = pl.BlockSpec((1, 1, t, 1), lambda b, h, a, j, nbr, nnb: (b, h, a, 0))
  key = pl.BlockSpec((1, 1, t, d), lambda b, h, a, j, nbr, nnb: (b, h, nbr_at(b, a, j, nbr), 0))
  key_bias = pl.BlockSpec((1, 1, 1, t),
                          lambda b, h, a, j, nbr, nnb: (b, nbr_at(b, a, j, nbr), 0, 0))
  summ = pl.BlockSpec((1, 1, s, d), lambda b, h, a, j, nbr, nnb: (b, h, summary(j), 0))
  far = pl.BlockSpec((1, 1, 1, s), lambda b, h, a, j, nbr, nnb: (b, a, 0, summary(j)))
  q_side = [own] + [own, own_rows, own_rows][:num_q_inputs - 1]
  return q_side + [key, key, key_bias, summ, summ, far], own, own_rows


def _mosaic_call(kernel, grid, in_specs, out_specs, out_shape, scratch,
                 interpret, name, *args, prefetch=()):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name=name,
  )(*prefetch, *args)


def _mosaic_prefetch(tables: _Tables):
  return tables.neighbours.reshape(-1), tables.num_neighbours.reshape(-1)


def _mosaic_fwd_kernel(nbr_ref, nnb_ref, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref, fb_ref,
                       o_ref, lse_ref, m_sc, l_sc, acc_sc, *, shape: _Shape):
  b, a, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    m_sc[...], l_sc[...], acc_sc[...] = _init_state(*acc_sc.shape)

  def update(k, v, bias):
    state = (m_sc[...], l_sc[...], acc_sc[...])
    m_sc[...], l_sc[...], acc_sc[...] = _softmax_step(state, q_ref[0, 0], k, v, bias,
                                                      shape.scale)

  pl.when(j < nnb_ref[b * shape.cubes + a])(
      lambda: update(k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0]))
  pl.when(j >= shape.k_max)(lambda: update(kbar_ref[0, 0], vbar_ref[0, 0], fb_ref[0, 0]))

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    o, lse = _finish(m_sc[...], l_sc[...], acc_sc[...])
    o_ref[0, 0] = o.astype(o_ref.dtype)
    lse_ref[0, 0] = lse


def _mosaic_dq_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                      kbar_ref, vbar_ref, fb_ref, dq_ref, dq_sc, *, shape: _Shape):
  b, a, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dq_sc[...] = jnp.zeros_like(dq_sc)

  def update(k, v, bias):
    dq_sc[...] += _dq_step(q_ref[0, 0], k, v, bias, do_ref[0, 0], lse_ref[0, 0],
                           delta_ref[0, 0], shape.scale)

  pl.when(j < nnb_ref[b * shape.cubes + a])(
      lambda: update(k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0]))
  pl.when(j >= shape.k_max)(lambda: update(kbar_ref[0, 0], vbar_ref[0, 0], fb_ref[0, 0]))

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dq_ref[0, 0] = dq_sc[...].astype(dq_ref.dtype)


def _mosaic_dkv_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                       dk_ref, dv_ref, dk_sc, dv_sc, *, shape: _Shape):
  """Key cube a; step j visits query cube neighbours[a, j] (the relation is symmetric)."""
  b, a, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  @pl.when(j < nnb_ref[b * shape.cubes + a])
  def _():
    dk, dv = _dkv_step(q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0], do_ref[0, 0],
                       lse_ref[0, 0], delta_ref[0, 0], shape.scale)
    dk_sc[...] += dk
    dv_sc[...] += dv

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    dk_ref[0, 0] = dk_sc[...].astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _mosaic_dsummary_kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, fb_ref,
                            dkbar_ref, dvbar_ref, dk_sc, dv_sc, *, shape: _Shape):
  """Summary block s; step a visits every query cube (far_bias masks the non-far ones)."""
  a = pl.program_id(3)

  @pl.when(a == 0)
  def _():
    dk_sc[...] = jnp.zeros_like(dk_sc)
    dv_sc[...] = jnp.zeros_like(dv_sc)

  dk, dv = _dkv_step(q_ref[0, 0], kbar_ref[0, 0], vbar_ref[0, 0], fb_ref[0, 0], do_ref[0, 0],
                     lse_ref[0, 0], delta_ref[0, 0], shape.scale)
  dk_sc[...] += dk
  dv_sc[...] += dv

  @pl.when(a == pl.num_programs(3) - 1)
  def _():
    dkbar_ref[0, 0] = dk_sc[...].astype(dkbar_ref.dtype)
    dvbar_ref[0, 0] = dv_sc[...].astype(dvbar_ref.dtype)


def _mosaic_forward(shape: _Shape, interpret, q, k, v, kbar, vbar, tables: _Tables):
  in_specs, own, own_rows = _mosaic_query_specs(shape, 1)
  grid = (shape.batch, shape.heads, shape.cubes, shape.k_max + shape.summary_blocks)
  return _mosaic_call(
      functools.partial(_mosaic_fwd_kernel, shape=shape), grid, in_specs,
      [own, own_rows], [jax.ShapeDtypeStruct(q.shape, q.dtype), _f32_rows(shape)],
      [pltpu.VMEM((shape.t, 1), _F32), pltpu.VMEM((shape.t, 1), _F32),
       pltpu.VMEM((shape.t, shape.d), _F32)],
      interpret, "pack3d_fwd", q, k, v, tables.key_bias, kbar, vbar, tables.far_bias,
      prefetch=_mosaic_prefetch(tables))


def _mosaic_backward(shape: _Shape, interpret, q, k, v, kbar, vbar, tables: _Tables, do, lse,
                     delta):
  prefetch = _mosaic_prefetch(tables)
  b, h, cubes, t, d = shape.batch, shape.heads, shape.cubes, shape.t, shape.d
  in_specs, own, own_rows = _mosaic_query_specs(shape, 4)
  dq = _mosaic_call(
      functools.partial(_mosaic_dq_kernel, shape=shape),
      (b, h, cubes, shape.k_max + shape.summary_blocks), in_specs, own,
      jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((t, d), _F32)], interpret,
      "pack3d_bwd_dq", q, do, lse, delta, k, v, tables.key_bias, kbar, vbar, tables.far_bias,
      prefetch=prefetch)

  # Key side: grid (b, h, key cube a, j); query cube neighbours[a, j].
  k_max = shape.k_max
  nbr_at = lambda b, a, j, nbr: nbr[(b * cubes + a) * k_max + j]
  other = pl.BlockSpec((1, 1, t, d), lambda b, h, a, j, nbr, nnb: (b, h, nbr_at(b, a, j, nbr), 0))
  other_rows = pl.BlockSpec((1, 1, t, 1),
                            lambda b, h, a, j, nbr, nnb: (b, h, nbr_at(b, a, j, nbr), 0))
  key_bias = pl.BlockSpec((1, 1, 1, t), lambda b, h, a, j, nbr, nnb: (b, a, 0, 0))
  dk, dv = _mosaic_call(
      functools.partial(_mosaic_dkv_kernel, shape=shape), (b, h, cubes, k_max),
      [other, other, other_rows, other_rows, own, own, key_bias], [own, own],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      [pltpu.VMEM((t, d), _F32)] * 2, interpret, "pack3d_bwd_dkv",
      q, do, lse, delta, k, v, tables.key_bias, prefetch=prefetch)

  # Summaries: grid (b, h, summary block s, query cube a).
  s = shape.s_block
  query = pl.BlockSpec((1, 1, t, d), lambda b, h, s, a: (b, h, a, 0))
  query_rows = pl.BlockSpec((1, 1, t, 1), lambda b, h, s, a: (b, h, a, 0))
  summ = pl.BlockSpec((1, 1, s, d), lambda b, h, s, a: (b, h, s, 0))
  far = pl.BlockSpec((1, 1, 1, s), lambda b, h, s, a: (b, a, 0, s))
  dkbar, dvbar = _mosaic_call(
      functools.partial(_mosaic_dsummary_kernel, shape=shape),
      (b, h, shape.summary_blocks, cubes), [query, query, query_rows, query_rows, summ, summ, far],
      [summ, summ], [jax.ShapeDtypeStruct(kbar.shape, kbar.dtype)] * 2,
      [pltpu.VMEM((s, d), _F32)] * 2, interpret, "pack3d_bwd_dsummary",
      q, do, lse, delta, kbar, vbar, tables.far_bias)
  return dq, dk, dv, dkbar, dvbar


# ----------------------------------------------------------------------------
# Triton (GPU): one program per (b, h, cube); the streams are fori_loops inside,
# reading tiles from refs passed whole.
# ----------------------------------------------------------------------------

def _rows(c, t):
  return pl.ds(pl.multiple_of(c * t, t), t)


def _neighbour_loop(nbr_ref, nnb_ref, body, init):
  """fori_loop over this program's neighbour cubes: body(c, carry) -> carry."""
  return jax.lax.fori_loop(0, nnb_ref[0, 0], lambda j, carry: body(nbr_ref[0, 0, j], carry),
                           init)


def _summary_loop(shape: _Shape, body, init):
  """fori_loop over the summary blocks: body(cols, carry) -> carry."""
  s = shape.s_block
  return jax.lax.fori_loop(0, shape.summary_blocks, lambda i, carry: body(_rows(i, s), carry),
                           init)


def _triton_fwd_kernel(nbr_ref, nnb_ref, q_ref, k_ref, v_ref, kb_ref, kbar_ref, vbar_ref,
                       fb_ref, o_ref, lse_ref, *, shape: _Shape):
  q, t = q_ref[0, 0], shape.t

  def local(c, state):
    return _softmax_step(state, q, k_ref[0, 0, _rows(c, t), :], v_ref[0, 0, _rows(c, t), :],
                         kb_ref[0, c], shape.scale)

  def far(cols, state):
    return _softmax_step(state, q, kbar_ref[0, 0, cols, :], vbar_ref[0, 0, cols, :],
                         fb_ref[0, 0, :, cols], shape.scale)

  state = _neighbour_loop(nbr_ref, nnb_ref, local, _init_state(*q.shape))
  o, lse = _finish(*_summary_loop(shape, far, state))
  o_ref[0, 0] = o.astype(o_ref.dtype)
  lse_ref[0, 0] = lse


def _triton_dq_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                      kbar_ref, vbar_ref, fb_ref, dq_ref, *, shape: _Shape):
  q, do, lse, delta, t = q_ref[0, 0], do_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0], shape.t

  def local(c, dq):
    return dq + _dq_step(q, k_ref[0, 0, _rows(c, t), :], v_ref[0, 0, _rows(c, t), :],
                         kb_ref[0, c], do, lse, delta, shape.scale)

  def far(cols, dq):
    return dq + _dq_step(q, kbar_ref[0, 0, cols, :], vbar_ref[0, 0, cols, :],
                         fb_ref[0, 0, :, cols], do, lse, delta, shape.scale)

  dq = _neighbour_loop(nbr_ref, nnb_ref, local, jnp.zeros(q.shape, _F32))
  dq_ref[0, 0] = _summary_loop(shape, far, dq).astype(dq_ref.dtype)


def _triton_dkv_kernel(nbr_ref, nnb_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kb_ref,
                       dk_ref, dv_ref, *, shape: _Shape):
  k, v, bias, t = k_ref[0, 0], v_ref[0, 0], kb_ref[0, 0], shape.t

  def local(c, carry):
    rows = _rows(c, t)
    dk, dv = _dkv_step(q_ref[0, 0, rows, :], k, v, bias, do_ref[0, 0, rows, :],
                       lse_ref[0, 0, rows, :], delta_ref[0, 0, rows, :], shape.scale)
    return carry[0] + dk, carry[1] + dv

  dk, dv = _neighbour_loop(nbr_ref, nnb_ref, local, (jnp.zeros(k.shape, _F32),) * 2)
  dk_ref[0, 0] = dk.astype(dk_ref.dtype)
  dv_ref[0, 0] = dv.astype(dv_ref.dtype)


def _triton_dsummary_kernel(q_ref, do_ref, lse_ref, delta_ref, kbar_ref, vbar_ref, fb_ref,
                            dkbar_ref, dvbar_ref, *, shape: _Shape):
  kbar, vbar, t, s = kbar_ref[0, 0], vbar_ref[0, 0], shape.t, shape.s_block
  cols = _rows(pl.program_id(2), s)

  def query_cube(a, carry):
    rows = _rows(a, t)
    dk, dv = _dkv_step(q_ref[0, 0, rows, :], kbar, vbar, fb_ref[0, a, :, cols],
                       do_ref[0, 0, rows, :], lse_ref[0, 0, rows, :], delta_ref[0, 0, rows, :],
                       shape.scale)
    return carry[0] + dk, carry[1] + dv

  dk, dv = jax.lax.fori_loop(0, shape.cubes, query_cube, (jnp.zeros(kbar.shape, _F32),) * 2)
  dkbar_ref[0, 0] = dk.astype(dkbar_ref.dtype)
  dvbar_ref[0, 0] = dv.astype(dvbar_ref.dtype)


_TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)


def _triton_call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, *args):
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, compiler_params=_TRITON_PARAMS,
                        interpret=interpret, name=name)(*args)


def _triton_specs(shape: _Shape):
  """Specs on grid (b, h, cube a): this cube's tiles, whole arrays, and the tables."""
  cubes, t, d, k_max = shape.cubes, shape.t, shape.d, shape.k_max
  n = cubes * t
  return dict(
      own=pl.BlockSpec((1, 1, t, d), lambda b, h, a: (b, h, a, 0)),
      own_rows=pl.BlockSpec((1, 1, t, 1), lambda b, h, a: (b, h, a, 0)),
      whole=pl.BlockSpec((1, 1, n, d), lambda b, h, a: (b, h, 0, 0)),
      whole_rows=pl.BlockSpec((1, 1, n, 1), lambda b, h, a: (b, h, 0, 0)),
      key_bias_all=pl.BlockSpec((1, cubes, 1, t), lambda b, h, a: (b, 0, 0, 0)),
      key_bias_own=pl.BlockSpec((1, 1, 1, t), lambda b, h, a: (b, a, 0, 0)),
      summ=pl.BlockSpec((1, 1, shape.c_s, d), lambda b, h, a: (b, h, 0, 0)),
      far=pl.BlockSpec((1, 1, 1, shape.c_s), lambda b, h, a: (b, a, 0, 0)),
      nbr=pl.BlockSpec((1, 1, k_max), lambda b, h, a: (b, a, 0)),
      nnb=pl.BlockSpec((1, 1), lambda b, h, a: (b, a)),
  )


def _triton_forward(shape: _Shape, interpret, q, k, v, kbar, vbar, tables: _Tables):
  sp = _triton_specs(shape)
  return _triton_call(
      functools.partial(_triton_fwd_kernel, shape=shape), (shape.batch, shape.heads, shape.cubes),
      [sp["nbr"], sp["nnb"], sp["own"], sp["whole"], sp["whole"], sp["key_bias_all"],
       sp["summ"], sp["summ"], sp["far"]],
      [sp["own"], sp["own_rows"]], [jax.ShapeDtypeStruct(q.shape, q.dtype), _f32_rows(shape)],
      interpret, "pack3d_fwd", tables.neighbours, tables.num_neighbours, q, k, v,
      tables.key_bias, kbar, vbar, tables.far_bias)


def _triton_backward(shape: _Shape, interpret, q, k, v, kbar, vbar, tables: _Tables, do, lse,
                     delta):
  sp = _triton_specs(shape)
  grid = (shape.batch, shape.heads, shape.cubes)
  nbr = (tables.neighbours, tables.num_neighbours)
  dq = _triton_call(
      functools.partial(_triton_dq_kernel, shape=shape), grid,
      [sp["nbr"], sp["nnb"], sp["own"], sp["own"], sp["own_rows"], sp["own_rows"], sp["whole"],
       sp["whole"], sp["key_bias_all"], sp["summ"], sp["summ"], sp["far"]],
      sp["own"], jax.ShapeDtypeStruct(q.shape, q.dtype), interpret, "pack3d_bwd_dq",
      *nbr, q, do, lse, delta, k, v, tables.key_bias, kbar, vbar, tables.far_bias)
  dk, dv = _triton_call(
      functools.partial(_triton_dkv_kernel, shape=shape), grid,
      [sp["nbr"], sp["nnb"], sp["whole"], sp["whole"], sp["whole_rows"], sp["whole_rows"],
       sp["own"], sp["own"], sp["key_bias_own"]],
      [sp["own"], sp["own"]],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret, "pack3d_bwd_dkv", *nbr, q, do, lse, delta, k, v, tables.key_bias)
  s, d, n = shape.s_block, shape.d, shape.cubes * shape.t
  whole = pl.BlockSpec((1, 1, n, d), lambda b, h, i: (b, h, 0, 0))
  whole_rows = pl.BlockSpec((1, 1, n, 1), lambda b, h, i: (b, h, 0, 0))
  summ = pl.BlockSpec((1, 1, s, d), lambda b, h, i: (b, h, i, 0))
  far = pl.BlockSpec((1, shape.cubes, 1, shape.c_s), lambda b, h, i: (b, 0, 0, 0))
  dkbar, dvbar = _triton_call(
      functools.partial(_triton_dsummary_kernel, shape=shape),
      (shape.batch, shape.heads, shape.summary_blocks),
      [whole, whole, whole_rows, whole_rows, summ, summ, far], [summ, summ],
      [jax.ShapeDtypeStruct(kbar.shape, kbar.dtype)] * 2, interpret, "pack3d_bwd_dsummary",
      q, do, lse, delta, kbar, vbar, tables.far_bias)
  return dq, dk, dv, dkbar, dvbar


# ----------------------------------------------------------------------------
# Per-backend padding: D (Triton: power of two) and the summary axis (a multiple of S).
# ----------------------------------------------------------------------------

_KERNELS = {
    "mosaic": (_mosaic_forward, _mosaic_backward),
    "triton": (_triton_forward, _triton_backward),
}


def _plan(backend: Backend, blocks: BlockSizes, q, tables: _Tables) -> _Shape:
  batch, heads, _, d = q.shape
  cubes, _, t = tables.key_bias.shape[1:]
  if backend == "triton":  # power-of-two tiles, >= 16 for tl.dot
    s = min(blocks.block_summaries, next_pow2(cubes))
    d_pad = next_pow2(d)
  else:  # Mosaic: S a multiple of 128 (lane axis of far_bias) or all summaries at once
    s = min(blocks.block_summaries, round_up(cubes, 8))
    d_pad = d
  return _Shape(batch, heads, cubes, t, d_pad, tables.neighbours.shape[2], s,
                round_up(cubes, s), 1.0 / math.sqrt(d))


def _pad_d(x, shape: _Shape):
  return jnp.pad(x, ((0, 0),) * 3 + ((0, shape.d - x.shape[3]),))


def _pad_summaries(shape: _Shape, kbar, vbar, tables: _Tables):
  extra = shape.c_s - shape.cubes
  pad_rows = lambda x: _pad_d(jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0))), shape)
  far = jnp.pad(tables.far_bias, ((0, 0), (0, 0), (0, 0), (0, extra)), constant_values=MASK)
  return pad_rows(kbar), pad_rows(vbar), dataclasses.replace(tables, far_bias=far)


def _forward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar,
             tables: _Tables):
  shape = _plan(backend, blocks, q, tables)
  kbar, vbar, tables = _pad_summaries(shape, kbar, vbar, tables)
  o, lse = _KERNELS[backend][0](shape, interpret, *(_pad_d(x, shape) for x in (q, k, v)),
                                kbar, vbar, tables)
  return o[..., :q.shape[3]], lse


def _backward(backend: Backend, interpret, blocks: BlockSizes, q, k, v, kbar, vbar,
              tables: _Tables, o, lse, do):
  shape = _plan(backend, blocks, q, tables)
  delta = jnp.sum(do.astype(_F32) * o.astype(_F32), axis=-1, keepdims=True)
  kbar_p, vbar_p, tables = _pad_summaries(shape, kbar, vbar, tables)
  q_p, k_p, v_p, do_p = (_pad_d(x, shape) for x in (q, k, v, do.astype(q.dtype)))
  grads = _KERNELS[backend][1](shape, interpret, q_p, k_p, v_p, kbar_p, vbar_p, tables, do_p,
                               lse, delta)
  d, cubes = q.shape[3], shape.cubes
  dq, dk, dv = (g[..., :d] for g in grads[:3])
  dkbar, dvbar = (g[:, :, :cubes, :d] for g in grads[3:])
  return dq, dk, dv, dkbar, dvbar


# ----------------------------------------------------------------------------
# Dispatch and autodiff.
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attend(q, k, v, kbar, vbar, tables, cfg: KernelConfig):
  return dispatch(_forward, cfg, q, k, v, kbar, vbar, tables)[0]


def _attend_fwd(q, k, v, kbar, vbar, tables, cfg):
  o, lse = dispatch(_forward, cfg, q, k, v, kbar, vbar, tables)
  return o, (q, k, v, kbar, vbar, tables, o, lse)


def _attend_bwd(cfg, residuals, do):
  grads = dispatch(_backward, cfg, *residuals, do)
  return (*grads, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def pack3d_attention(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4),
                     radius_blocks: int = 1, block_bias: bool = True, summary_rope=None,
                     max_cubes: int | None = None, interpret=None,
                     backend: Backend | None = None, **block_sizes):
  """Pack3D attention as Pallas kernels, differentiable in q, k and v.

  Args:
    q, k, v: [B, N, H, D] (q, k already rotated), float32 or bfloat16.
    coords: int [B, N, 3] (z, y, x) in each token's field; field_ids: int [B, N].
    block_shape, radius_blocks, block_bias, summary_rope, max_cubes: as in
      `jaxops.pack3d.pack3d_attention` (the gated merge is an XLA-path option only).
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Triton);
      True (or a `pltpu.InterpretParams`) interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic" or "triton"); with `interpret` this runs the
      other platform's kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (block_summaries).

  Returns:
    o [B, N, H, D] in q.dtype; matmuls in the input dtype, softmax in float32.
  """
  check_pack3d_inputs(q, k, v, coords, field_ids, block_shape, radius_blocks)
  cfg = KernelConfig.make("pack3d_attention", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes)
  layout = cube_layout(coords, field_ids, block_shape=block_shape, radius_blocks=radius_blocks,
                       max_cubes=max_cubes, slots_per_cube=next_pow2(math.prod(block_shape)))
  q_c, k_c, v_c = (layout.to_cubes(x) for x in (q, k, v))        # [B, C, T, H, D]
  kbar, vbar = cube_summaries(layout, k_c, v_c, coords, summary_rope)
  batch, cubes, t, heads, d = q_c.shape
  to_heads = lambda x: jnp.moveaxis(x, 3, 1).reshape(batch, heads, cubes * t, d)
  summaries = lambda x: jnp.moveaxis(x, 2, 1).astype(q.dtype)    # [B, H, C, D]
  tables = _Tables(key_bias=jnp.where(layout.key_valid(), 0.0, MASK)[:, :, None, :],
                   far_bias=layout.far_bias(block_bias)[:, :, None, :],
                   neighbours=layout.neighbours, num_neighbours=layout.num_neighbours)
  o = _attend(to_heads(q_c), to_heads(k_c), to_heads(v_c), summaries(kbar), summaries(vbar),
              tables, cfg)
  o_c = jnp.moveaxis(o.reshape(batch, heads, cubes, t, d), 1, 3)
  return layout.from_cubes(o_c)
