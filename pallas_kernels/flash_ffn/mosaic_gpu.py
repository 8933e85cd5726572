"""FlashFFN on Hopper and Blackwell GPUs (Mosaic GPU, jax >= 0.11.2): TMA loads into shared
memory, tensor-core matmuls with float32 accumulators, one warpgroup per block. The tensor
core is the chip's (`mosaic_gpu_common`): Hopper's WGMMA, accumulators in registers;
Blackwell's tcgen05, accumulators in tensor memory, every tile 128 rows (tcgen05's M) and
the running sums loaded into registers once, at the end.

Forward and dq/dr kernels: one block per (head, token tile of bq). The block loads its
tokens of q (and ds) and the router's [E, bq] block once, then a pipelined loop over every
(expert e, d_e tile c) streams the table tiles in (`plgpu.emit_pipeline`, `num_stages`
buffers each) and accumulates [bq, d_h]. Tiles are [bq, bi]: tokens are M (block_q a
multiple of 64; Blackwell: 128). The dK/dU/dV kernel: one block per (head, e, tile of
`rows_dkuv` table rows); it keeps its table tiles in shared memory and streams every token
tile through, tiles [rows, bk] (rows are M: a multiple of 64; Blackwell: 128). When three
[rows, d_h] float32 accumulators would not fit (Hopper: the register file next to the
tiles; Blackwell: tensor memory next to the step's products), it makes two passes over the
tokens: dK and dU, then dV (which recomputes its two scores).

The elementwise tile math is `tiles.weighted_activation` and `tiles.activation_grads`,
the formula the Mosaic (TPU) and Triton kernels use.

Operands. WGMMA reads B from shared memory; A here always comes from shared memory too
(the activations and their gradients are written there in the input dtype), which is what
the Mosaic GPU interpreter can run. bfloat16 operands may be stored either way round (the
instruction transposes 16-bit operands). Float32 runs as TensorFloat-32 products with
float32 accumulation (as Triton's float32 dots do by default; the interpreter on CPU
computes in float32), and TF32 WGMMA wants both operands K-major: the float32 path also
streams transposed copies that XLA makes before the kernels (V^T in the forward; K^T, U^T
in the dq kernel; q^T, ds^T in the dK/dU/dV kernel); tcgen05 runs the same code. All
shared-memory operands of a kernel share one swizzle (an MMA needs A's and B's to match).
On a real chip `dispatch` serves 16-bit inputs only (`dispatch.mosaic_gpu_dtype_ok`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from neurips26_jax.jaxops.tiling import round_up
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_module
from neurips26_jax.pallas_kernels.flash_ffn import mosaic_gpu_ws
from neurips26_jax.pallas_kernels.flash_ffn.tiles import (TilePlan, activation_grads,
                                                          weighted_activation)
from neurips26_jax.pallas_kernels.mosaic_gpu_common import (accumulators, blackwell,
                                                            compiler_params, interpret_params, mma,
                                                            mma_wait, products, read,
                                                            smem_transforms, store_operands)

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where a head's token rows live: flat [T, H * d] or head-major [H, T, d]."""

  flat: bool
  d: int

  def head(self, ref, h):
    """The [T, d] view of head h."""
    return ref.at[:, pl.ds(h * self.d, self.d)] if self.flat else ref.at[h]

  def rows(self, ref, h, start, count):
    return self.head(ref, h).at[pl.ds(start, count)]


def _operand(plgpu, shape, dtype, transforms):
  """A shared-memory A operand [M, K] in the WGMMA layout (tiled, swizzled)."""
  return plgpu.SMEM(shape, dtype, transforms=transforms)


def _not_first(idx):
  """Whether a pipeline step at grid index `idx` adds to its accumulators (not the first)."""
  return functools.reduce(jnp.logical_or, [i > 0 for i in idx])


def _two_byte(dtype) -> bool:
  return jnp.dtype(dtype).itemsize == 2


def _table_specs(plgpu, bi: int, d: int, transforms):
  """Block specs of one head's tables [E, d_e, d] for the (e, c) loop: (tiles [bi, d], the
  transposed copy's tiles [d, bi])."""
  return (lambda: plgpu.BlockSpec((None, bi, d), lambda e, c: (e, c, 0), transforms=transforms),
          lambda: plgpu.BlockSpec((None, d, bi), lambda e, c: (e, 0, c), transforms=transforms))


def forward(plan: TilePlan, q, r, k, u, v, interpret):
  if plan.blocks.compute_wgs == 2:
    return mosaic_gpu_ws.forward(plan, _Layout(plan.flat, plan.d_h), q, r, k, u, v, interpret)
  plgpu = mosaic_gpu_module()
  bq, bi, d, steps = plan.blocks.block_q, plan.blocks.block_inter, plan.d_h, plan.blocks.num_stages
  dtype, layout, wide = q.dtype, _Layout(plan.flat, d), _two_byte(q.dtype)
  transforms = smem_transforms(plgpu, dtype, d, bi)
  table, table_t = _table_specs(plgpu, bi, d, transforms)
  # V is B of (a @ V): [bi, d] as stored for 16-bit; float32 reads V^T [d, bi] (K-major).
  v_in, v_spec = (v, table()) if wide else (jnp.swapaxes(v, 2, 3), table_t())

  def kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, q_s, r_s, a_s, bar):
    h, t0 = lax.axis_index("h"), lax.axis_index("i") * bq
    plgpu.copy_gmem_to_smem(layout.rows(q_ref, h, t0, bq), q_s, bar.at[0])
    plgpu.copy_gmem_to_smem(r_ref.at[h, :, pl.ds(t0, bq)], r_s, bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    plgpu.barrier_wait(bar.at[1])

    def run(acc):
      def step(idx, k_s, u_s, v_s):
        m, n = products(plgpu, (bq, bi), [(q_s, k_s.transpose((1, 0))),
                                           (q_s, u_s.transpose((1, 0)))])
        r_e = lax.broadcast_in_dim(r_s[idx[0]], (bq, bi), [0])
        store_operands(plgpu, [(a_s, weighted_activation(m, n, r_e))])
        mma(plgpu, acc, a_s, v_s if wide else v_s.transpose((1, 0)), accumulate=_not_first(idx))
        mma_wait(plgpu, acc)  # a_s and the tiles' slots are reused

      plgpu.emit_pipeline(step, grid=(plan.experts, plan.d_e // bi),
                          in_specs=[table(), table(), v_spec], max_concurrent_steps=steps,
                          )(k_ref.at[h], u_ref.at[h], v_ref.at[h])
      return read(plgpu, acc)[0]

    o = accumulators(plgpu, run, (bq, d))
    q_s[...] = o.astype(dtype)  # q's buffer is free: every WGMMA reading it has finished
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, layout.rows(o_ref, h, t0, bq))
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=plan.token_shape(dtype),
      scratch_types=[plgpu.SMEM((bq, d), dtype, transforms=transforms),
                     plgpu.SMEM((plan.experts, bq), _F32),
                     _operand(plgpu, (bq, bi), dtype, transforms),
                     plgpu.Barrier(num_barriers=2)],
      grid=(plan.heads, plan.tokens // bq), grid_names=("h", "i"),
      compiler_params=compiler_params(plgpu), interpret=interpret_params(plgpu, interpret),
      kernel_name="flash_ffn_fwd",
  )(q, r, k, u, v_in)


def backward(plan: TilePlan, q, r, r_dkuv, k, u, v, ds, interpret):
  del r_dkuv  # one router layout, [H, E, T], serves both kernels
  if plan.blocks.compute_wgs == 2:
    layout = _Layout(plan.flat, plan.d_h)
    return (*mosaic_gpu_ws.dq_dr(plan, layout, q, r, ds, k, u, v, interpret),
            *mosaic_gpu_ws.dkuv(plan, layout, q, r, ds, k, u, v, interpret))
  plgpu = mosaic_gpu_module()
  dq, dr = _dq_dr(plgpu, plan, q, r, ds, k, u, v, interpret)
  dk, du, dv = _dkuv(plgpu, plan, q, r, ds, k, u, v, interpret)
  return dq, dr, dk, du, dv


def _dq_dr(plgpu, plan: TilePlan, q, r, ds, k, u, v, interpret):
  bq, bi, d, steps = plan.blocks.block_q, plan.blocks.block_inter, plan.d_h, plan.blocks.num_stages
  dtype, layout, wide = q.dtype, _Layout(plan.flat, d), _two_byte(q.dtype)
  transforms = smem_transforms(plgpu, dtype, d, bi)
  # K and U are also B of (dm @ K), (dn @ U): float32 reads them again as K^T, U^T.
  extra = () if wide else (jnp.swapaxes(k, 2, 3), jnp.swapaxes(u, 2, 3))
  table, table_t = _table_specs(plgpu, bi, d, transforms)

  def kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, *rest):
    t_refs, rest = rest[:len(extra)], rest[len(extra):]
    dq_ref, dr_ref, q_s, ds_s, r_s, dr_s, dm_s, dn_s, bar = rest
    h, t0 = lax.axis_index("h"), lax.axis_index("i") * bq
    plgpu.copy_gmem_to_smem(layout.rows(q_ref, h, t0, bq), q_s, bar.at[0])
    plgpu.copy_gmem_to_smem(layout.rows(ds_ref, h, t0, bq), ds_s, bar.at[1])
    plgpu.copy_gmem_to_smem(r_ref.at[h, :, pl.ds(t0, bq)], r_s, bar.at[2])
    for j in range(3):
      plgpu.barrier_wait(bar.at[j])

    def run(acc):
      def step(idx, k_s, u_s, v_s, *t_s):
        e, c = idx
        m, n, da = products(plgpu, (bq, bi), [(q_s, k_s.transpose((1, 0))),
                                               (q_s, u_s.transpose((1, 0))),
                                               (ds_s, v_s.transpose((1, 0)))])
        r_e = lax.broadcast_in_dim(r_s[e], (bq, bi), [0])
        a, dm, dn = activation_grads(m, n, da, r_e)
        dr_e = jnp.sum(da * a, axis=1)

        @pl.when(c == 0)
        def _():
          dr_s[e] = dr_e

        @pl.when(c > 0)
        def _():
          dr_s[e] = dr_s[e] + dr_e

        store_operands(plgpu, [(dm_s, dm), (dn_s, dn)])
        k_b, u_b = (k_s, u_s) if wide else (t.transpose((1, 0)) for t in t_s)
        mma(plgpu, acc, dm_s, k_b, accumulate=_not_first(idx))
        mma(plgpu, acc, dn_s, u_b)
        mma_wait(plgpu, acc)

      plgpu.emit_pipeline(step, grid=(plan.experts, plan.d_e // bi),
                          in_specs=[table(), table(), table()] + [table_t() for _ in extra],
                          max_concurrent_steps=steps,
                          )(k_ref.at[h], u_ref.at[h], v_ref.at[h], *(t.at[h] for t in t_refs))
      return read(plgpu, acc)[0]

    dq = accumulators(plgpu, run, (bq, d))
    q_s[...] = dq.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_s, layout.rows(dq_ref, h, t0, bq))
    plgpu.copy_smem_to_gmem(dr_s, dr_ref.at[h, :, pl.ds(t0, bq)])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=[plan.token_shape(dtype), plan.router_shape()],
      scratch_types=[plgpu.SMEM((bq, d), dtype, transforms=transforms),
                     plgpu.SMEM((bq, d), dtype, transforms=transforms),
                     plgpu.SMEM((plan.experts, bq), _F32),
                     plgpu.SMEM((plan.experts, bq), _F32),
                     _operand(plgpu, (bq, bi), dtype, transforms),
                     _operand(plgpu, (bq, bi), dtype, transforms),
                     plgpu.Barrier(num_barriers=3)],
      grid=(plan.heads, plan.tokens // bq), grid_names=("h", "i"),
      compiler_params=compiler_params(plgpu), interpret=interpret_params(plgpu, interpret),
      kernel_name="flash_ffn_bwd_dq",
  )(q, r, ds, k, u, v, *extra)


def _dkuv_passes(rows: int, d: int, bk: int):
  """Which of (dK, dU, dV) each pass over the tokens accumulates: all three at once when
  their float32 accumulators fit, else dK and dU, then dV (which recomputes the two scores
  it needs). Hopper: they fit in at most 128 registers per thread. Blackwell: the three
  [rows, d] accumulators and, scoped inside them, the step's three [rows, bk] products
  (float32, one column per element of a row) fit the 512 columns of tensor memory. Pallas
  sizes the block's allocation as the sum over nested scopes of each buffer's columns
  rounded up to 8 (the 128 x 8 allocation chunk; the buffers themselves sit at 4-column
  offsets), then rounds that total up to a power of two, so 512 is the bound on the sum."""
  if blackwell():
    fits = 3 * round_up(d, 8) + 3 * round_up(bk, 8) <= 512
  else:
    fits = 3 * (rows * d // 128) <= 128
  return ((0, 1, 2),) if fits else ((0, 1), (2,))


def _dkuv(plgpu, plan: TilePlan, q, r, ds, k, u, v, interpret):
  bk, bi, d, steps = plan.blocks.block_q_dkv, plan.rows_dkuv, plan.d_h, plan.blocks.num_stages
  dtype, layout, wide = q.dtype, _Layout(plan.flat, d), _two_byte(q.dtype)
  transforms = smem_transforms(plgpu, dtype, d, bk)
  passes = _dkuv_passes(bi, d, bk)

  # q and ds are also B of (dm^T @ q), (dn^T @ q), ((r a)^T @ ds): float32 reads them again
  # as q^T, ds^T [H, d, T].
  def transposed(x):
    x = x.reshape(plan.tokens, plan.heads, d) if plan.flat else jnp.swapaxes(x, 0, 1)
    return jnp.transpose(x, (1, 2, 0))
  extra = () if wide else (transposed(q), transposed(ds))
  rows_spec = plgpu.BlockSpec((bk, d), lambda t: (t, 0), transforms=transforms)
  cols_spec = plgpu.BlockSpec((d, bk), lambda t: (0, t), transforms=transforms)
  router_spec = plgpu.BlockSpec((bk,), lambda t: (t,))

  def kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, *rest):
    t_refs, rest = rest[:len(extra)], rest[len(extra):]
    dk_ref, du_ref, dv_ref, k_s, u_s, v_s, o_s, dm_s, dn_s, ra_s, bar = rest
    h, e, c = lax.axis_index("h"), lax.axis_index("e"), lax.axis_index("c")
    rows = pl.ds(c * bi, bi)
    for j, (src, dst) in enumerate(((k_ref, k_s), (u_ref, u_s), (v_ref, v_s))):
      plgpu.copy_gmem_to_smem(src.at[h, e, rows], dst, bar.at[j])
    for j in range(3):
      plgpu.barrier_wait(bar.at[j])
    # The token streams: name -> (this head's [T, ...] view, its block spec).
    streams = {"q": (layout.head(q_ref, h), rows_spec), "ds": (layout.head(ds_ref, h), rows_spec),
               "r": (r_ref.at[h, e], router_spec)}
    if not wide:
      streams.update(qt=(t_refs[0].at[h], cols_spec), dst=(t_refs[1].at[h], cols_spec))
    q_b, ds_b = ("q", "ds") if wide else ("qt", "dst")

    def run(outs, *accs):
      grads = dict(zip(outs, accs))
      kuv = 0 in grads or 1 in grads
      names = ["q", "r"] + (["ds", q_b] if kuv else []) + ([ds_b] if 2 in grads else [])
      names = list(dict.fromkeys(names))

      def step(idx, *refs):
        s = dict(zip(names, refs))
        q_t = s["q"].transpose((1, 0))
        pairs = [(k_s, q_t), (u_s, q_t)] + ([(v_s, s["ds"].transpose((1, 0)))] if kuv else [])
        scores = products(plgpu, (bi, bk), pairs)
        r_e = lax.broadcast_in_dim(s["r"][...], (bi, bk), [1])
        operands = []
        if kuv:
          a, dm, dn = activation_grads(*scores, r_e)
          operands += [(dm_s, dm), (dn_s, dn)]
          if 2 in grads:
            operands.append((ra_s, r_e * a))
        else:
          operands.append((ra_s, weighted_activation(*scores, r_e)))
        store_operands(plgpu, operands)
        for j, lhs in ((0, dm_s), (1, dn_s)):
          if j in grads:
            mma(plgpu, grads[j], lhs, s[q_b] if wide else s[q_b].transpose((1, 0)),
                accumulate=_not_first(idx))
        if 2 in grads:
          mma(plgpu, grads[2], ra_s, s[ds_b] if wide else s[ds_b].transpose((1, 0)),
              accumulate=_not_first(idx))
        mma_wait(plgpu, accs[0])

      plgpu.emit_pipeline(step, grid=(plan.tokens // bk,),
                          in_specs=[streams[n][1] for n in names], max_concurrent_steps=steps,
                          )(*(streams[n][0] for n in names))
      # One accumulator at a time into registers (three [rows, d] at once would spill).
      for j, acc in grads.items():
        (g,) = read(plgpu, acc)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_s's last copy has read it
        o_s[...] = g.astype(o_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, out_refs[j].at[h, e, rows])

    out_refs = (dk_ref, du_ref, dv_ref)
    for outs in passes:
      accumulators(plgpu, functools.partial(run, outs), *((bi, d) for _ in outs))
    plgpu.wait_smem_to_gmem(0)

  table = lambda: plgpu.SMEM((bi, d), k.dtype, transforms=transforms)
  return plgpu.kernel(
      kernel,
      out_type=[plan.table_shape(k.dtype)] * 3,
      scratch_types=[table(), table(), table(), table()]
      + [_operand(plgpu, (bi, bk), dtype, transforms) for _ in range(3)]
      + [plgpu.Barrier(num_barriers=3)],
      grid=(plan.heads, plan.experts, plan.d_e // bi), grid_names=("h", "e", "c"),
      compiler_params=compiler_params(plgpu), interpret=interpret_params(plgpu, interpret),
      kernel_name="flash_ffn_bwd_dkuv",
  )(q, r, ds, k, u, v, *extra)
