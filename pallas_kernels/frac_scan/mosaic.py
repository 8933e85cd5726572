"""FRAC scan on TPU (Mosaic): grid (group g, step i) with the step axis "arbitrary", each
step `plan.chunk`-token chunks in a loop (`BlockSizes.chunks_per_step`, `fwd_unroll` or
`bwd_unroll` of them unrolled); the states of all modes live in one float32 VMEM scratch
[M_pad * N, P] across it (mode j in rows j*N .. j*N+N-1; padded modes stay zero) and each
chunk runs `frac_chunk`'s stacked form, every mode in one matmul (contraction M_pad * N, not
N); rate/weight gradients accumulate in resident output blocks.

Layouts: on TPU a token-major [Q, w] tile fills a 128-lane row per token in HBM too, so the
narrow per-token arrays travel lane-dense where the math allows: a chunk's cumulative dt and
its cotangent as one row ([G, C, 1, Q]); dt b transposed [G, N, Lp] for the forward (which
needs it only there), dt b and c both ways for the backward, which writes their cotangents
transposed (its matmuls take c and dt b token-major as well: transposing them in the kernel
cost more than the DMAs)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from neurips26_jax.jaxops.frac_chunk import (Modes, TilePlan, chunk_backward_stacked,
                                             chunk_forward_stacked)

_F32 = jnp.float32


def _modes(rates_ref, weights_ref) -> Modes:
  return Modes(rates_ref[0], weights_ref[0])


def _chunks_per_step(plan: TilePlan, blocks) -> int:
  """The largest power of two <= blocks.chunks_per_step that divides the chunk count."""
  steps = 1
  while steps * 2 <= blocks.chunks_per_step and plan.num_chunks % (steps * 2) == 0:
    steps *= 2
  return steps


def _rows(plan: TilePlan, u, first=0):
  """The u-th chunk of a grid step's tokens (u traced), those starting at `first`."""
  return pl.ds(pl.multiple_of(first + u * plan.chunk, plan.chunk), plan.chunk)


def _by_chunk(plan: TilePlan, t):
  """[G, Lp, 1] -> [G, C, 1, Q]: a chunk's t (or its cotangent) as one row. As [G, Lp, 1] it
  would take a 128-lane row per token in HBM and in the DMAs (the reshape is a bitcast for
  XLA, which fuses it into t's cumulative sum)."""
  return t.reshape(t.shape[0], plan.num_chunks, 1, plan.chunk)


def _in_input_dtype(dy, x):
  """dy [G, Lp, P] float32 in x's dtype, exactly: y is returned in that dtype, so the values
  of its cotangent are in it too (half the bytes for 16-bit inputs). The kernel takes it
  back to float32 (kept in bf16 the backward's matmuls were 6% slower in libtpu's estimate)."""
  return dy.astype(x.dtype)


def _fwd_kernel(x_ref, bd_t_ref, c_ref, t_ref, rates_ref, weights_ref, s0_ref, y_ref, s_ref,
                *rest, plan: TilePlan, per_step: int, unroll: int, first_col,
                save_starts: bool):
  starts_ref, state = rest if save_starts else (None, *rest)
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    state[...] = s0_ref[0]

  def chunk(u, carry):
    rows, cols = _rows(plan, u), _rows(plan, u, first_col(i))
    if save_starts:
      starts_ref[0, u] = state[...]
    y, state[...] = chunk_forward_stacked(x_ref[0, rows], bd_t_ref[0, :, cols], c_ref[0, rows],
                                          t_ref[0, u], _modes(rates_ref, weights_ref),
                                          state[...], num_modes=plan.m)
    y_ref[0, rows] = y.astype(y_ref.dtype)
    return carry

  jax.lax.fori_loop(0, per_step, chunk, 0, unroll=unroll)

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    s_ref[0] = state[...]


def _bwd_kernel(x_ref, bd_ref, bd_t_ref, c_ref, c_t_ref, t_ref, rates_ref, weights_ref,
                start_ref, dy_ref, ds_ref, dx_ref, dbd_t_ref, dc_t_ref, dt_ref, drates_ref,
                dweights_ref, ds0_ref, dstate, *, plan: TilePlan, per_step: int, unroll: int,
                first_col):
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    dstate[...] = ds_ref[0]
    drates_ref[...] = jnp.zeros_like(drates_ref)
    dweights_ref[...] = jnp.zeros_like(dweights_ref)

  def chunk(v, carry):
    u = per_step - 1 - v                       # the step's chunks in reverse
    rows, cols = _rows(plan, u), _rows(plan, u, first_col(i))
    dy = dy_ref[0, rows].astype(_F32)
    dx, dbd_t, dc_t, dt, dmodes, dstate[...] = chunk_backward_stacked(
        x_ref[0, rows], bd_ref[0, rows], bd_t_ref[0, :, cols], c_ref[0, rows],
        c_t_ref[0, :, cols], t_ref[0, u], _modes(rates_ref, weights_ref), start_ref[0, u], dy,
        dstate[...], num_modes=plan.m)
    dx_ref[0, rows], dt_ref[0, u] = dx, dt
    dbd_t_ref[0, :, cols], dc_t_ref[0, :, cols] = dbd_t, dc_t
    drates_ref[0] += dmodes.rates
    dweights_ref[0] += dmodes.weights
    return carry

  jax.lax.fori_loop(0, per_step, chunk, 0, unroll=unroll)

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    ds0_ref[0] = dstate[...]


class _Specs:
  """BlockSpecs on the grid (g, i) of a grid step's tokens: `tokens(w)` for [G, Lp, w]
  arrays, `transposed` for [G, N, Lp] ones (`first_col(i)`: the step's first token in its
  block), `t_rows` for t by chunk, `modes` for the rows [G, 1, m_pad]."""

  def __init__(self, plan: TilePlan, per_step: int, step_index):
    tokens = per_step * plan.chunk
    self.tokens = lambda w: pl.BlockSpec((1, tokens, w), lambda g, i: (g, step_index(i), 0))
    # a [G, N, Lp] block: a grid step's tokens where they fill 128-lane tiles, else (chunks
    # under 128 tokens) the whole padded length, read from the step's first column
    whole = tokens % 128 != 0 and tokens != plan.length
    self.transposed = pl.BlockSpec((1, plan.n, plan.length if whole else tokens),
                                   lambda g, i: (g, 0, 0 if whole else step_index(i)))
    self.first_col = (lambda i: step_index(i) * tokens) if whole else (lambda i: 0)
    self.t_rows = pl.BlockSpec((1, per_step, 1, plan.chunk),
                               lambda g, i: (g, step_index(i), 0, 0))
    self.modes = [pl.BlockSpec((1, 1, plan.m_pad), lambda g, i: (g, 0, 0))] * 2


def _transposed(a):
  """[G, Lp, N] <-> [G, N, Lp]: dt b and c (and their cotangents) where the kernels want them
  lane-dense (XLA fuses the transpose into the producer or the consumer)."""
  return jnp.swapaxes(a, 1, 2)


def _params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def forward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, state, *,
            save_starts: bool):
  g, k, per_step = x.shape[0], plan.m_pad * plan.n, _chunks_per_step(plan, blocks)
  specs = _Specs(plan, per_step, lambda i: i)
  whole_state = pl.BlockSpec((1, k, plan.p), lambda g, i: (g, 0, 0))
  out_specs = [specs.tokens(plan.p), whole_state]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, _F32)]
  if save_starts:
    out_specs.append(pl.BlockSpec((1, per_step, k, plan.p), lambda g, i: (g, i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((g, plan.num_chunks, k, plan.p), _F32))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan, per_step=per_step,
                        unroll=min(blocks.fwd_unroll, per_step), first_col=specs.first_col,
                        save_starts=save_starts),
      grid=(g, plan.num_chunks // per_step),
      in_specs=[specs.tokens(plan.p), specs.transposed, specs.tokens(plan.n), specs.t_rows,
                *specs.modes, whole_state],
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((k, plan.p), _F32)],
      compiler_params=_params(),
      interpret=interpret,
      name="frac_scan_fwd",
  )(x, _transposed(bd), c, _by_chunk(plan, t), *modes, state)
  return tuple(outs) if save_starts else (*outs, None)


def backward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, starts, dy, dstate):
  g, k, per_step = x.shape[0], plan.m_pad * plan.n, _chunks_per_step(plan, blocks)
  n_steps = plan.num_chunks // per_step
  rev = lambda i: n_steps - 1 - i
  specs = _Specs(plan, per_step, rev)
  whole_state = pl.BlockSpec((1, k, plan.p), lambda g, i: (g, 0, 0))
  t_rows = _by_chunk(plan, t)
  grads = pl.pallas_call(
      functools.partial(_bwd_kernel, plan=plan, per_step=per_step,
                        unroll=min(blocks.bwd_unroll, per_step), first_col=specs.first_col),
      grid=(g, n_steps),
      in_specs=[specs.tokens(plan.p), specs.tokens(plan.n), specs.transposed,
                specs.tokens(plan.n), specs.transposed, specs.t_rows, *specs.modes,
                pl.BlockSpec((1, per_step, k, plan.p), lambda g, i: (g, rev(i), 0, 0)),
                specs.tokens(plan.p), whole_state],
      out_specs=[specs.tokens(plan.p), specs.transposed, specs.transposed, specs.t_rows,
                 *specs.modes, whole_state],
      out_shape=[jax.ShapeDtypeStruct(a.shape, _F32) for a in
                 (x, _transposed(bd), _transposed(c), t_rows, *modes, dstate)],
      scratch_shapes=[pltpu.VMEM((k, plan.p), _F32)],
      compiler_params=_params(),
      interpret=interpret,
      name="frac_scan_bwd",
  )(x, bd, _transposed(bd), c, _transposed(c), t_rows, *modes, starts, _in_input_dtype(dy, x),
    dstate)
  dx, dbd_t, dc_t, dt, drates, dweights, ds0 = grads
  return (dx, _transposed(dbd_t), _transposed(dc_t), dt.reshape(t.shape),
          Modes(drates, dweights), ds0)
