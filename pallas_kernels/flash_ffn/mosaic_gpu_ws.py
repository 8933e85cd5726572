"""FlashFFN's forward on Hopper in FlashAttention-3's layout (Mosaic GPU, 16-bit inputs):
warp-specialized, two consumer warpgroups in ping-pong, the activation fed to the second
matmul from registers. Chosen by `BlockSizes.compute_wgs = 2`; `mosaic_gpu.forward` is the
one-warpgroup kernel it is measured against.

One CTA per (head, 2 x block_q tokens): three warpgroups.
- The producer (warpgroup 2, 40 registers per thread) streams the head's table tiles K, U,
  V [bi, d_h] for every (expert e, d_e tile c) step through `num_stages` shared-memory slots
  with TMA, each slot reused once both consumers have released it (`consumed`, 2 arrivals).
  Both consumers read the same tiles, so a head's tables cross L2 once per 2 x block_q tokens
  instead of once per block_q.
- Each consumer (warpgroups 0 and 1, 232 registers per thread) owns block_q tokens: q [bq,
  d_h] in shared memory, its router block [E, bq], and a [bq, d_h] float32 accumulator in
  registers. Per step: m = q K^T and n = q U^T (WGMMA, A and B from shared memory), then
  a = r_e silu(m) n (`tiles.weighted_activation`) in registers, converted to the input dtype
  and used as WGMMA's A operand straight from registers for acc += a V: no shared-memory
  round trip or fence for the activation.
- Approximate math (`approx_math=True`, this body only): the sigmoid is `tiles.tanh_sigmoid`,
  one `tanh.approx.f32` (MUFU.TANH) per element where the exact kernels spend an exp, a
  reciprocal and their refinement (`make sass`: 319 instructions per 64-wide step against
  747). PTX gives tanh.approx.f32 a maximum error of about 2^-11, so silu(m) = m sigmoid(m)
  is off by at most |m| 2^-12: below the bf16 rounding of the activation (2^-9 relative)
  that the down matmul reads. The interpreter computes the exact formula; the GPU check
  (`benchmarks/gpu_flash_ffn.py`) holds the compiled body to the bf16 tolerance.
- Ping-pong: a schedule barrier (2 arrivals) orders the consumers' tensor-core phases, so
  that one warpgroup's activation math runs while the other's matmuls do (FA3's "pingpong"
  scheduling; jax-ml/jax's attention_mgpu forward uses the same barrier).

A step leaves its a V matmul in flight: the next step's score matmuls are issued behind it,
and reading their results waits for both, after which the previous step's slot is released
(delayed release, as `wgmma_wait(1)` would give). The Mosaic GPU interpreter runs WGMMA with A
from shared memory only: there (and only there) the activation goes through a buffer, so
its tests check everything but the register operand, which the compile check and the SASS
report (`make sass`: HGMMA with A from registers) see.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import mosaic_gpu_module
from pallas_kernels.flash_ffn.tiles import TilePlan, tanh_sigmoid, weighted_activation
from pallas_kernels.mosaic_gpu_common import interpret_params, smem_transforms, store_operands

_F32 = jnp.float32
CONSUMERS = 2                       # compute warpgroups (the schedule barrier pairs two)
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40   # 2 x 232 + 40 <= 512 per 128 threads


def forward(plan: TilePlan, layout, q, r, k, u, v, interpret):
  """o [tokens, H d_h] or [H, tokens, d_h] (as `layout`) for 16-bit q and tables."""
  plgpu = mosaic_gpu_module()
  bq, bi, d, stages = plan.blocks.block_q, plan.blocks.block_inter, plan.d_h, plan.blocks.num_stages
  dtype = q.dtype
  chunks = plan.d_e // bi
  steps = plan.experts * chunks
  stages = min(stages, steps)
  transforms = smem_transforms(plgpu, dtype, d, bi)

  def kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, q_s, r_s, ku_s, v_s, k_bar, u_bar,
             v_bar, consumed, q_bar, schedule, a_s=None):
    h, wg = lax.axis_index("h"), lax.axis_index("wg")
    tables = ((k_ref, ku_s, 0, k_bar), (u_ref, ku_s, bi, u_bar), (v_ref, v_s, 0, v_bar))

    def tensor_core_turn():
      plgpu.barrier_arrive(schedule)
      plgpu.barrier_wait(schedule)

    @pl.when(wg < CONSUMERS)
    def _consumer():
      plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
      t0 = (lax.axis_index("i") * CONSUMERS + wg) * bq
      q_w, r_w = q_s.at[wg], r_s.at[wg]
      plgpu.copy_gmem_to_smem(layout.rows(q_ref, h, t0, bq), q_w, q_bar.at[wg])
      plgpu.copy_gmem_to_smem(r_ref.at[h, :, pl.ds(t0, bq)], r_w, q_bar.at[CONSUMERS + wg])
      plgpu.barrier_wait(q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[CONSUMERS + wg])
      pl.when(wg == 1)(tensor_core_turn)   # warpgroup 0 takes the tensor cores first

      def run(acc):
        def step(n, _):
          slot = lax.rem(n, stages)
          plgpu.barrier_wait(k_bar.at[slot])
          plgpu.barrier_wait(u_bar.at[slot])

          def scores(s_acc):
            plgpu.wgmma(s_acc, q_w, ku_s.at[slot].transpose((1, 0)))
            tensor_core_turn()             # the other consumer's matmuls go next
            # Reading them waits for every WGMMA in flight: step n - 1's a V too.
            return s_acc[...]

          s = pl.run_scoped(scores, plgpu.ACC((bq, 2 * bi), _F32))
          m, g = s[:, :bi], s[:, bi:]

          @pl.when(n > 0)
          def _():  # step n - 1's slot is free only now (its a V was left in flight)
            plgpu.barrier_arrive(consumed.at[lax.rem(n + stages - 1, stages)])

          r_e = lax.broadcast_in_dim(r_w[lax.div(n, chunks)], (bq, bi), [0])
          a = weighted_activation(m, g, r_e, sigmoid=tanh_sigmoid)
          plgpu.barrier_arrive(schedule)   # activation done: this warpgroup's turn is next
          plgpu.barrier_wait(v_bar.at[slot])
          plgpu.barrier_wait(schedule)
          plgpu.wgmma(acc, down_operand(a), v_s.at[slot])   # left in flight

        lax.fori_loop(0, steps, step, None)
        return acc[...]

      def down_operand(a):
        """The activation as WGMMA's A: from registers when compiled; the interpreter runs
        WGMMA from shared memory only, so there it goes through a buffer."""
        if a_s is None:
          return a.astype(dtype)
        store_operands(plgpu, [(a_s.at[wg], a)])
        return a_s.at[wg]

      o = pl.run_scoped(run, plgpu.ACC((bq, d), _F32))  # (the last steps' slots are not reused)
      pl.when(wg == 0)(tensor_core_turn)   # pairs warpgroup 1's first turn
      q_w[...] = o.astype(dtype)           # q's buffer is free: its last WGMMA is done
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_w, layout.rows(o_ref, h, t0, bq))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == CONSUMERS)
    def _producer():
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

      def load(n, slot):
        e, rows = lax.div(n, chunks), pl.ds(lax.rem(n, chunks) * bi, bi)
        for ref, buf, row, bar in tables:
          plgpu.copy_gmem_to_smem(ref.at[h, e, rows], buf.at[slot, pl.ds(row, bi)], bar.at[slot])

      for n in range(stages):
        load(n, n)

      @pl.loop(0, steps - stages)
      def _(n):
        slot = lax.rem(n, stages)
        plgpu.barrier_wait(consumed.at[slot])   # both consumers are done with step n
        load(n + stages, slot)

  table = lambda: plgpu.SMEM((stages, bi, d), dtype, transforms=transforms)
  slots = lambda: plgpu.Barrier(num_barriers=stages)
  return plgpu.kernel(
      kernel,
      out_type=plan.token_shape(dtype),
      scratch_types=[plgpu.SMEM((CONSUMERS, bq, d), dtype, transforms=transforms),
                     plgpu.SMEM((CONSUMERS, plan.experts, bq), _F32),
                     plgpu.SMEM((stages, 2 * bi, d), dtype, transforms=transforms), table(),
                     slots(), slots(), slots(),
                     plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
                     plgpu.Barrier(num_barriers=2 * CONSUMERS),
                     plgpu.Barrier(num_arrivals=CONSUMERS)]
      + ([plgpu.SMEM((CONSUMERS, bq, bi), dtype, transforms=transforms)] if interpret else []),
      grid=(plan.heads, plan.tokens // (CONSUMERS * bq)), grid_names=("h", "i"),
      num_threads=CONSUMERS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(plgpu, interpret),
      kernel_name="flash_ffn_fwd_ws",
  )(q, r, k, u, v)
