"""FlashFFN's kernels on Hopper in FlashAttention-3's layout (Mosaic GPU, 16-bit inputs):
warp-specialized, two consumer warpgroups in ping-pong, the tensor cores' A operands from
registers. Chosen by `BlockSizes.compute_wgs = 2` for all three kernels (forward, dq/dr,
dK/dU/dV); `mosaic_gpu.py` holds the one-warpgroup kernels they are measured against.

The forward and dq/dr kernels (`_kernel`, one skeleton): one CTA per (head, 2 x block_q
tokens), three warpgroups.
- The producer (warpgroup 2, 40 registers per thread) streams the head's tables for every
  (expert e, d_e tile c) step through `num_stages` shared-memory slots with TMA: K and U
  tiles [bi, d_h] into the two halves of one [2 bi, d_h] buffer, V into another; a slot is
  reused once both consumers have released it (`consumed`, 2 arrivals). Both consumers read
  the same tiles, so a head's tables cross L2 once per 2 x block_q tokens, not per block_q.
- Each consumer (warpgroups 0 and 1, 232 registers per thread) owns block_q tokens (q [bq,
  d_h] and its router block [E, bq] in shared memory) and a [bq, d_h] float32 accumulator.
  Per step it computes the gate and up scores [m | n] = q [K; U]^T as one WGMMA of N = 2 bi,
  then the tile math in registers, then accumulates with A straight from registers:
    forward: a = r_e silu(m) n (`tiles.weighted_activation`); o += a V.
    dq/dr:   also da = ds V^T (one more WGMMA beside the scores); (a, dm, dn) =
             `tiles.activation_grads`; dq += dm K + dn U; dr_e += rowsum(da a) (in shared
             memory across the expert's d_e tiles).
- Ping-pong: a schedule barrier (2 arrivals) orders the consumers' tensor-core phases, so
  that one warpgroup's tile math runs while the other's matmuls do (FA3's "pingpong"
  scheduling; jax-ml/jax's attention_mgpu forward uses the same barrier).
- The dK/dU/dV kernel (`dkuv`) turns this around: the CTA keeps 64 table rows and the
  producer streams token tiles; consumer 0 sums dK and dU, consumer 1 dV, in one pass over
  the tokens.
- A step leaves its accumulating matmuls in flight: the next step's score matmuls are issued
  behind them, and reading the scores waits for both, after which the previous step's slot
  is released (delayed release, as `wgmma_wait(1)` would give).
- Approximate math (`approx_math=True`, these bodies only): the sigmoid is
  `tiles.tanh_sigmoid`, one `tanh.approx.f32` (MUFU.TANH) per element where the exact
  kernels spend an exp, a reciprocal and their refinement (`make sass`). PTX gives
  tanh.approx.f32 an error of about 2^-11, so sigmoid is off by ~2^-12 absolute, and silu(m)
  = m sigmoid(m) and its derivative by ~|m| 2^-12: about the bf16 rounding (2^-9 relative)
  of the operands the accumulating matmuls read where |silu(m)| is of the order of |m|, but
  larger than it, relative to silu itself, for m <= -3 (silu(-8) = -0.003 is off by up to
  ~70%), where the terms are small. The interpreter computes the exact formula; the GPU
  check (the repository's `benchmarks/gpu_flash_ffn.py`) holds the compiled bodies to the
  bf16 tolerance.

The Mosaic GPU interpreter runs WGMMA with A from shared memory only: there (and only there)
the register operands go through buffers, so its tests check everything but the register
operands, which the compile check and the SASS report (HGMMA with A from registers) see.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_module
from neurips26_jax.pallas_kernels.flash_ffn.tiles import (TilePlan, activation_grads, tanh_sigmoid,
                                                          weighted_activation)
from neurips26_jax.pallas_kernels.mosaic_gpu_common import (interpret_params, smem_transforms,
                                                            store_operands)

_F32 = jnp.float32
CONSUMERS = 2                       # compute warpgroups (the schedule barrier pairs two)
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40   # 2 x 232 + 40 <= 512 per 128 threads


@dataclasses.dataclass(frozen=True)
class _Step:
  """One consumer's view of step n: the slot's table tiles (`ku` [2 bi, d_h], K's rows then
  U's; `v` [bi, d_h]), the expert `e` and d_e tile `c`, and the synchronisation the step
  calls in this order: wait_v() before reading V's tile; turn() after issuing the score
  matmuls (the other consumer's go next) and before reading them; release_previous() once
  they are read (that read waited for step n - 1's matmuls too); handoff() when the tile math
  is done and take() before issuing the accumulating matmuls. operand(x, j) makes a float32
  register tile WGMMA's A operand (j: its interpreter buffer)."""

  ku: Any
  v: Any
  e: Any
  c: Any
  wait_v: Callable
  turn: Callable
  release_previous: Callable
  handoff: Callable
  take: Callable
  operand: Callable


def _turn(plgpu, schedule):
  """This consumer's tensor-core turn ends and the other's begins (the schedule barrier)."""
  plgpu.barrier_arrive(schedule)
  plgpu.barrier_wait(schedule)


def _release_previous(plgpu, consumed, n, stages: int):
  """Step n - 1's slot back to the producer: its matmuls were left in flight until step n
  read its scores (which waits for every WGMMA issued before)."""
  @pl.when(n > 0)
  def _():
    plgpu.barrier_arrive(consumed.at[lax.rem(n + stages - 1, stages)])


def _stream(plgpu, load, steps: int, stages: int, consumed):
  """The producer's loop: load(n, slot) for steps 0..steps-1 through `stages` slots, each
  slot refilled once both consumers have released its previous step."""
  for n in range(stages):
    load(n, n)

  @pl.loop(0, steps - stages)
  def _(n):
    slot = lax.rem(n, stages)
    plgpu.barrier_wait(consumed.at[slot])   # both consumers are done with step n
    load(n + stages, slot)


def _operand(plgpu, value, buf, dtype):
  """A float32 register tile as WGMMA's A operand: from registers when compiled (buf None);
  the interpreter runs WGMMA from shared memory only, so there through `buf`."""
  if buf is None:
    return value.astype(dtype)
  store_operands(plgpu, [(buf, value)])
  return buf


def _kernel(plan: TilePlan, layout, name: str, tokens, router, extra, outs, step_fn, finish_fn,
            tables, interpret, operands: int):
  """The warp-specialized kernel over one head's (e, c) steps.

  tokens: arrays of token rows (q, ds: `layout`) each consumer loads for its block_q tokens
    into a [bq, d_h] buffer; router: the [H, E, T] router, loaded as [E, bq].
  extra: shapes of more float32 per-consumer buffers. outs: the kernel's out_type.
  step_fn(step, acc, bufs): one step (bufs: the token buffers, the router's, the extras);
    it accumulates into `acc`, a [bq, d_h] float32 WGMMA accumulator.
  finish_fn(result, bufs, out_refs, h, t0): writes a consumer's outputs (result: acc's value).
  operands: register A operands per step."""
  plgpu = mosaic_gpu_module()
  bq, bi, d = plan.blocks.block_q, plan.blocks.block_inter, plan.d_h
  dtype = tokens[0].dtype
  chunks = plan.d_e // bi
  steps = plan.experts * chunks
  stages = min(plan.blocks.num_stages, steps)
  # bi: the K extent of V's and the K / U halves' tiles as B operands (WGMMA wants K a
  # multiple of the swizzle's width), and the interpreter's A buffers' minor dim
  transforms = smem_transforms(plgpu, dtype, d, bi)
  loads = len(tokens) + 1

  def kernel(*refs):
    ins, rest = refs[:loads + 3], refs[loads + 3:]
    out_refs, rest = rest[:len(outs)], rest[len(outs):]
    ku_s, v_s, k_bar, u_bar, v_bar, consumed, in_bar, schedule, *bufs = rest
    a_s = bufs.pop() if interpret else None
    k_ref, u_ref, v_ref = ins[loads:]
    h, wg = lax.axis_index("h"), lax.axis_index("wg")
    turn = lambda: _turn(plgpu, schedule)

    @pl.when(wg < CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      t0 = (lax.axis_index("i") * CONSUMERS + wg) * bq
      mine = [buf.at[wg] for buf in bufs]
      sources = [layout.rows(ref, h, t0, bq) for ref in ins[:loads - 1]]
      sources.append(ins[loads - 1].at[h, :, pl.ds(t0, bq)])
      for j, (src, buf) in enumerate(zip(sources, mine)):
        plgpu.copy_gmem_to_smem(src, buf, in_bar.at[j * CONSUMERS + wg])
      for j in range(loads):
        plgpu.barrier_wait(in_bar.at[j * CONSUMERS + wg])
      pl.when(wg == 1)(turn)   # warpgroup 0 takes the tensor cores first

      operand = lambda value, j: _operand(plgpu, value,
                                          None if a_s is None else a_s.at[wg, j], dtype)

      def run(acc):
        def step(n, _):
          slot = lax.rem(n, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(u_bar.at[slot])
          step_fn(_Step(ku_s.at[slot], v_s.at[slot], lax.div(n, chunks), lax.rem(n, chunks),
                        wait_v=lambda: plgpu.barrier_wait(v_bar.at[slot]), turn=turn,
                        release_previous=lambda: _release_previous(plgpu, consumed, n, stages),
                        handoff=lambda: plgpu.barrier_arrive(schedule),
                        take=lambda: plgpu.barrier_wait(schedule), operand=operand),
                  acc, mine)

        lax.fori_loop(0, steps, step, None)
        return acc[...]   # (the last steps' slots are not reused: never released)

      result = pl.run_scoped(run, plgpu.ACC((bq, d), _F32))
      pl.when(wg == 0)(turn)   # pairs warpgroup 1's first turn
      finish_fn(result, mine, out_refs, h, t0)

    @pl.when(wg == CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      streams = ((k_ref, ku_s, 0, k_bar), (u_ref, ku_s, bi, u_bar), (v_ref, v_s, 0, v_bar))

      def load(n, slot):
        e, rows = lax.div(n, chunks), pl.ds(lax.rem(n, chunks) * bi, bi)
        for ref, buf, row, bar in streams:
          plgpu.copy_gmem_to_smem(ref.at[h, e, rows], buf.at[slot, pl.ds(row, bi)], bar.at[slot])

      _stream(plgpu, load, steps, stages, consumed)

  slots = lambda: plgpu.Barrier(num_barriers=stages)
  tiles = lambda *shape: plgpu.SMEM(shape, dtype, transforms=transforms)
  return plgpu.kernel(
      kernel,
      out_type=outs,
      scratch_types=[tiles(stages, 2 * bi, d), tiles(stages, bi, d), slots(), slots(), slots(),
                     plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                     plgpu.Barrier(num_barriers=loads * CONSUMERS),
                     plgpu.Barrier(num_arrivals=CONSUMERS)]
      + [tiles(CONSUMERS, bq, d) for _ in tokens]
      + [plgpu.SMEM((CONSUMERS, plan.experts, bq), _F32)]
      + [plgpu.SMEM((CONSUMERS, *shape), _F32) for shape in extra]
      + ([tiles(CONSUMERS, operands, bq, bi)] if interpret else []),
      grid=(plan.heads, plan.tokens // (CONSUMERS * bq)), grid_names=("h", "i"),
      num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(plgpu, interpret),
      kernel_name=name,
  )(*tokens, router, *tables)


def _router_tile(r_buf, e, shape):
  """The expert's router weights [bq] of a consumer's block, broadcast over a [bq, bi] tile."""
  return lax.broadcast_in_dim(r_buf[e], shape, [0])


def _write_tokens(plgpu, layout, value, buf, out_ref, h, t0):
  """A consumer's [bq, d_h] result to its token rows, through `buf` (a token buffer whose
  readers are all done)."""
  buf[...] = value.astype(buf.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(buf, layout.rows(out_ref, h, t0, buf.shape[0]))


def forward(plan: TilePlan, layout, q, r, k, u, v, interpret):
  """o in q's layout (as `mosaic_gpu.forward`) for 16-bit q and tables."""
  plgpu = mosaic_gpu_module()
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter

  def step(s: _Step, acc, bufs):
    q_w, r_w = bufs

    def scores(s_acc):
      plgpu.wgmma(s_acc, q_w, s.ku.transpose((1, 0)))
      s.turn()
      return s_acc[...]

    mn = pl.run_scoped(scores, plgpu.ACC((bq, 2 * bi), _F32))
    s.release_previous()
    a = weighted_activation(mn[:, :bi], mn[:, bi:], _router_tile(r_w, s.e, (bq, bi)),
                            sigmoid=tanh_sigmoid)
    s.handoff()
    s.wait_v()
    s.take()
    plgpu.wgmma(acc, s.operand(a, 0), s.v)   # left in flight

  def finish(o, bufs, out_refs, h, t0):
    _write_tokens(plgpu, layout, o, bufs[0], out_refs[0], h, t0)
    plgpu.wait_smem_to_gmem(0)

  return _kernel(plan, layout, "flash_ffn_fwd_ws", [q], r, [], [plan.token_shape(q.dtype)],
                 step, finish, (k, u, v), interpret, 1)[0]


def dq_dr(plan: TilePlan, layout, q, r, ds, k, u, v, interpret):
  """(dq in q's layout, dr [H, E, T] float32), as `mosaic_gpu`'s dq/dr kernel."""
  plgpu = mosaic_gpu_module()
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter

  def step(s: _Step, acc, bufs):
    q_w, ds_w, r_w, dr_w = bufs
    s.wait_v()

    def scores(s_acc, da_acc):
      plgpu.wgmma(s_acc, q_w, s.ku.transpose((1, 0)))
      plgpu.wgmma(da_acc, ds_w, s.v.transpose((1, 0)))
      s.turn()
      return s_acc[...], da_acc[...]

    mn, da = pl.run_scoped(scores, plgpu.ACC((bq, 2 * bi), _F32), plgpu.ACC((bq, bi), _F32))
    s.release_previous()
    a, dm, dn = activation_grads(mn[:, :bi], mn[:, bi:], da, _router_tile(r_w, s.e, (bq, bi)),
                                 sigmoid=tanh_sigmoid)
    dr_e = jnp.sum(da * a, axis=1)   # summed over the expert's d_e tiles

    @pl.when(s.c == 0)
    def _():
      dr_w[s.e] = dr_e

    @pl.when(s.c > 0)
    def _():
      dr_w[s.e] = dr_w[s.e] + dr_e

    s.handoff()
    s.take()
    plgpu.wgmma(acc, s.operand(dm, 0), s.ku.at[pl.ds(0, bi)])    # left in flight
    plgpu.wgmma(acc, s.operand(dn, 1), s.ku.at[pl.ds(bi, bi)])

  def finish(dq, bufs, out_refs, h, t0):
    q_w, _, _, dr_w = bufs
    _write_tokens(plgpu, layout, dq, q_w, out_refs[0], h, t0)
    plgpu.copy_smem_to_gmem(dr_w, out_refs[1].at[h, :, pl.ds(t0, bq)])
    plgpu.wait_smem_to_gmem(0)

  return _kernel(plan, layout, "flash_ffn_bwd_dq_ws", [q, ds], r, [(plan.experts, bq)],
                 [plan.token_shape(q.dtype), plan.router_shape()], step, finish, (k, u, v),
                 interpret, 2)


DKUV_ROWS = 64   # table rows per CTA: WGMMA's M (two [64, d_h] float32 sums fit a consumer)


def dkuv(plan: TilePlan, layout, q, r, ds, k, u, v, interpret):
  """(dK, dU, dV) in the tables' layout, as `mosaic_gpu`'s dK/dU/dV kernel, in one pass over
  the tokens.

  One CTA per (head, expert, 64 table rows); its three [64, d_h] table tiles stay in shared
  memory while the producer streams token tiles (q, ds [bk, d_h] and the expert's router
  row [bk]) through `num_stages` slots. Consumer 0 accumulates dK and dU (it computes the
  three scores m = K q^T, n = U q^T, da = V ds^T and the gradients dm, dn); consumer 1
  accumulates dV (it computes m and n, and r a); both from registers as A. The one-warpgroup
  kernel holds all three sums at once only where they fit its registers (then 6 matmul
  units per token tile), else walks the tokens twice (8); here each consumer holds its own:
  8 units (m and n are computed by both), the tokens read once."""
  plgpu = mosaic_gpu_module()
  rows, bk, d = DKUV_ROWS, plan.blocks.block_q_dkv, plan.d_h
  dtype = q.dtype
  steps = plan.tokens // bk
  stages = min(plan.blocks.num_stages, steps)
  transforms = smem_transforms(plgpu, dtype, d, bk)   # bk: the token tiles' K extent as B

  def kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dk_ref, du_ref, dv_ref,
             tables, q_s, ds_s, r_s, out_s, table_bar, q_bar, ds_bar, r_bar, consumed, schedule,
             *a_s):
    h, e, c, wg = (lax.axis_index(n) for n in ("h", "e", "c", "wg"))
    table_rows = pl.ds(c * rows, rows)
    k_s, u_s, v_s = (tables.at[j] for j in range(3))
    turn = lambda: _turn(plgpu, schedule)
    operand = lambda value, j: _operand(plgpu, value, a_s[0].at[j] if a_s else None, dtype)

    def consume(grads):
      """The loop of consumer `wg`: grads are its accumulators (dK, dU or dV)."""
      plgpu.barrier_wait(table_bar)
      pl.when(wg == 1)(turn)   # consumer 0 takes the tensor cores first

      def step(n, _):
        slot = lax.rem(n, stages)
        q_t, ds_t = q_s.at[slot], ds_s.at[slot]
        plgpu.barrier_wait(q_bar.at[slot])
        plgpu.barrier_wait(ds_bar.at[slot])
        plgpu.barrier_wait(r_bar.at[slot])
        pairs = [(k_s, q_t), (u_s, q_t)] + ([(v_s, ds_t)] if len(grads) == 2 else [])

        def scores(*accs):
          for acc, (table, tokens) in zip(accs, pairs):
            plgpu.wgmma(acc, table, tokens.transpose((1, 0)))
          turn()
          return tuple(acc[...] for acc in accs)   # waits for step n - 1's sums too

        products = pl.run_scoped(scores, *(plgpu.ACC((rows, bk), _F32) for _ in pairs))
        _release_previous(plgpu, consumed, n, stages)

        r_e = lax.broadcast_in_dim(r_s[slot], (rows, bk), [1])
        if len(grads) == 2:   # dK += dm q, dU += dn q
          _, dm, dn = activation_grads(*products, r_e, sigmoid=tanh_sigmoid)
          terms = [(dm, q_t), (dn, q_t)]
        else:                 # dV += (r a) ds
          terms = [(weighted_activation(*products, r_e, sigmoid=tanh_sigmoid), ds_t)]
        turn()   # tile math done; the tensor cores are this consumer's again
        for j, (acc, (lhs, rhs)) in enumerate(zip(grads, terms)):
          plgpu.wgmma(acc, operand(lhs, wg * 2 + j), rhs)   # left in flight

      lax.fori_loop(0, steps, step, None)
      values = tuple(acc[...] for acc in grads)
      pl.when(wg == 0)(turn)   # pairs consumer 1's first turn
      return values

    def write(values, first):
      for j, value in enumerate(values):
        out_s[first + j] = value.astype(out_s.dtype)
      plgpu.commit_smem()
      for j, ref in enumerate((dk_ref, du_ref, dv_ref)[first:first + len(values)]):
        plgpu.copy_smem_to_gmem(out_s.at[first + j], ref.at[h, e, table_rows])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 0)
    def _():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      write(pl.run_scoped(lambda *accs: consume(accs), plgpu.ACC((rows, d), _F32),
                          plgpu.ACC((rows, d), _F32)), 0)

    @pl.when(wg == 1)
    def _():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      write(pl.run_scoped(lambda acc: consume((acc,)), plgpu.ACC((rows, d), _F32)), 2)

    @pl.when(wg == CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
      for j, ref in enumerate((k_ref, u_ref, v_ref)):
        plgpu.copy_gmem_to_smem(ref.at[h, e, table_rows], tables.at[j], table_bar)

      def load(n, slot):
        t = pl.ds(n * bk, bk)
        plgpu.copy_gmem_to_smem(layout.rows(q_ref, h, n * bk, bk), q_s.at[slot], q_bar.at[slot])
        plgpu.copy_gmem_to_smem(layout.rows(ds_ref, h, n * bk, bk), ds_s.at[slot],
                                ds_bar.at[slot])
        plgpu.copy_gmem_to_smem(r_ref.at[h, e, t], r_s.at[slot], r_bar.at[slot])

      _stream(plgpu, load, steps, stages, consumed)

  tiles = lambda *shape, dt=dtype: plgpu.SMEM(shape, dt, transforms=transforms)
  slots = lambda: plgpu.Barrier(num_barriers=stages)
  return plgpu.kernel(
      kernel,
      out_type=[plan.table_shape(k.dtype)] * 3,
      scratch_types=[tiles(3, rows, d, dt=k.dtype), tiles(stages, bk, d), tiles(stages, bk, d),
                     plgpu.SMEM((stages, bk), _F32), tiles(3, rows, d, dt=k.dtype),
                     plgpu.Barrier(num_arrivals=3), slots(), slots(), slots(),
                     plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                     plgpu.Barrier(num_arrivals=CONSUMERS)]
      + ([tiles(3, rows, bk)] if interpret else []),
      grid=(plan.heads, plan.experts, plan.d_e // rows), grid_names=("h", "e", "c"),
      num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(plgpu, interpret),
      kernel_name="flash_ffn_bwd_dkuv_ws",
  )(q, r, ds, k, u, v)
