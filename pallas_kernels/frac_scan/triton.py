"""FRAC scan on GPU (Triton): grid (group g, column block pb of P, mode block mb).

Grid steps cannot carry state, so a `fori_loop` walks the chunks inside each program,
carrying its block of modes' states ([N, p_block] float32 each) in registers. Columns of
P are independent, and so are modes given the inputs: each program writes its share of
y (its modes' part of Lmix and of the state term) and of the gradients of the shared
inputs, and XLA adds the shares. Splitting the modes keeps a program's live state small
(all 16 modes in one program spill kilobytes of registers) and gives the GPU more
programs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from neurips26_jax.jaxops.frac_chunk import Modes, TilePlan, chunk_backward, chunk_forward

_F32 = jnp.float32


def _mode_rows(plan: TilePlan, j):
  return pl.ds(j * plan.n, plan.n)


def _fwd_kernel(x_ref, bd_ref, c_ref, t_ref, rates_ref, weights_ref, s0_ref, y_ref, s_ref,
                *starts_ref, plan: TilePlan):
  modes = Modes(rates_ref[0], weights_ref[0])
  q = plan.chunk

  def body(i, states):
    rows = pl.ds(pl.multiple_of(i * q, q), q)
    for j, s in enumerate(states):
      if starts_ref:
        starts_ref[0][0, i, _mode_rows(plan, j), :] = s
    y, states = chunk_forward(x_ref[0, rows, :], bd_ref[0, rows, :], c_ref[0, rows, :],
                              t_ref[0, rows, :], modes, states)
    y_ref[0, 0, rows, :] = y
    return tuple(states)

  init = tuple(s0_ref[0, _mode_rows(plan, j), :] for j in range(plan.m_block))
  states = jax.lax.fori_loop(0, plan.num_chunks, body, init)
  for j, s in enumerate(states):
    s_ref[0, _mode_rows(plan, j), :] = s


def _bwd_kernel(x_ref, bd_ref, c_ref, t_ref, rates_ref, weights_ref, starts_ref, dy_ref, ds_ref,
                dx_ref, dbd_ref, dc_ref, dt_ref, drates_ref, dweights_ref, ds0_ref, *,
                plan: TilePlan):
  modes = Modes(rates_ref[0], weights_ref[0])
  q, n_chunks = plan.chunk, plan.num_chunks

  def body(k, carry):
    dstates, dmodes = carry
    i = n_chunks - 1 - k
    rows = pl.ds(pl.multiple_of(i * q, q), q)
    starts = [starts_ref[0, i, _mode_rows(plan, j), :] for j in range(plan.m_block)]
    dx, dbd, dc, dt, dm, dstates = chunk_backward(
        x_ref[0, rows, :], bd_ref[0, rows, :], c_ref[0, rows, :], t_ref[0, rows, :], modes,
        starts, dy_ref[0, rows, :], dstates)
    dx_ref[0, 0, rows, :] = dx
    dbd_ref[0, 0, rows, :], dc_ref[0, 0, rows, :], dt_ref[0, 0, rows, :] = dbd, dc, dt
    return tuple(dstates), Modes(*(a + b for a, b in zip(dmodes, dm)))

  init = (tuple(ds_ref[0, _mode_rows(plan, j), :] for j in range(plan.m_block)),
          Modes(*(jnp.zeros_like(m) for m in modes)))
  dstates, dmodes = jax.lax.fori_loop(0, n_chunks, body, init)
  for j, d in enumerate(dstates):
    ds0_ref[0, _mode_rows(plan, j), :] = d
  drates_ref[0, 0] = dmodes.rates
  dweights_ref[0, 0] = dmodes.weights


def _params(blocks):
  return pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


class _Specs:
  """BlockSpecs on the grid (g, pb, mb)."""

  def __init__(self, plan: TilePlan):
    seq = lambda w: pl.BlockSpec((1, plan.length, w), lambda g, pb, mb: (g, 0, 0))
    row = pl.BlockSpec((1, 1, plan.m_block), lambda g, pb, mb: (g, 0, mb))
    k = plan.m_block * plan.n
    self.columns = pl.BlockSpec((1, plan.length, plan.p_block), lambda g, pb, mb: (g, 0, pb))
    self.inputs = [self.columns, seq(plan.n), seq(plan.n), seq(1), row, row]  # x bd c t modes
    self.state = pl.BlockSpec((1, k, plan.p_block), lambda g, pb, mb: (g, mb, pb))
    self.starts = pl.BlockSpec((1, plan.num_chunks, k, plan.p_block),
                               lambda g, pb, mb: (g, 0, mb, pb))
    # Per-mode-block shares of a [G, L, p] result, and per-program shares of [G, L, w].
    self.column_share = pl.BlockSpec((1, 1, plan.length, plan.p_block),
                                     lambda g, pb, mb: (g, mb, 0, pb))
    nmb = plan.num_m_blocks
    self.share = lambda w: pl.BlockSpec((1, 1, plan.length, w),
                                        lambda g, pb, mb: (g, pb * nmb + mb, 0, 0))
    self.mode_share = pl.BlockSpec((1, 1, 1, plan.m_block), lambda g, pb, mb: (g, pb, 0, mb))


def _program_plan(plan: TilePlan, blocks) -> TilePlan:
  """Each program's share: p_block columns (both powers of two: it divides p) and m_block
  modes (a power of two <= m_align: it divides m_pad)."""
  return dataclasses.replace(plan, p_block=min(blocks.p_block, plan.p),
                             m_block=min(blocks.m_block, plan.m_align))


def forward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, state, *,
            save_starts: bool):
  plan = _program_plan(plan, blocks)
  sp, g = _Specs(plan), x.shape[0]
  out_specs = [sp.column_share, sp.state]
  out_shape = [jax.ShapeDtypeStruct((g, plan.num_m_blocks) + x.shape[1:], _F32),
               jax.ShapeDtypeStruct(state.shape, _F32)]
  if save_starts:
    out_specs.append(sp.starts)
    out_shape.append(jax.ShapeDtypeStruct((g, plan.num_chunks) + state.shape[1:], _F32))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan),
      grid=(g, plan.num_p_blocks, plan.num_m_blocks),
      in_specs=sp.inputs + [sp.state],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_params(blocks),
      interpret=interpret,
      name="frac_scan_fwd",
  )(x, bd, c, t, *modes, state)
  y = jnp.sum(outs[0], axis=1).astype(x.dtype)
  return (y, outs[1], outs[2] if save_starts else None)


def backward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, starts, dy, dstate):
  plan = _program_plan(plan, blocks)
  sp, g = _Specs(plan), x.shape[0]
  npb, nmb = plan.num_p_blocks, plan.num_m_blocks
  shares = lambda a, count: jax.ShapeDtypeStruct((g, count) + a.shape[1:], _F32)
  grads = pl.pallas_call(
      functools.partial(_bwd_kernel, plan=plan),
      grid=(g, npb, nmb),
      in_specs=sp.inputs + [sp.starts, sp.columns, sp.state],
      out_specs=[sp.column_share, sp.share(plan.n), sp.share(plan.n), sp.share(1),
                 sp.mode_share, sp.mode_share, sp.state],
      out_shape=[shares(x, nmb), shares(bd, npb * nmb), shares(c, npb * nmb),
                 shares(t, npb * nmb), shares(modes.rates, npb), shares(modes.weights, npb),
                 jax.ShapeDtypeStruct(dstate.shape, _F32)],
      compiler_params=_params(blocks),
      interpret=interpret,
      name="frac_scan_bwd",
  )(x, bd, c, t, *modes, starts, dy, dstate)
  dx, dbd, dc, dt, drates, dweights, ds0 = grads
  total = lambda a: jnp.sum(a, axis=1)
  return total(dx), total(dbd), total(dc), total(dt), Modes(total(drates), total(dweights)), ds0
