"""FRAC scan on TPU (Mosaic): grid (group g, chunk i) with the chunk axis "arbitrary";
the states of all modes live in one float32 VMEM scratch [M_pad * N, P] across it
(mode j in rows j*N .. j*N+N-1; padded modes stay zero) and each chunk runs
`frac_chunk`'s stacked form, every mode in one matmul (contraction M_pad * N, not N);
rate/weight gradients accumulate in resident output blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxops.frac_chunk import Modes, TilePlan, chunk_backward_stacked, chunk_forward_stacked

_F32 = jnp.float32


def _modes(rates_ref, weights_ref) -> Modes:
  return Modes(rates_ref[0], weights_ref[0])


def _fwd_kernel(x_ref, bd_ref, c_ref, t_ref, rates_ref, weights_ref, s0_ref, y_ref, s_ref,
                *rest, plan: TilePlan, save_starts: bool):
  starts_ref, state = rest if save_starts else (None, *rest)
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    state[...] = s0_ref[0]

  if save_starts:
    starts_ref[0, 0] = state[...]
  y, state[...] = chunk_forward_stacked(x_ref[0], bd_ref[0], c_ref[0], t_ref[0],
                                        _modes(rates_ref, weights_ref), state[...],
                                        num_modes=plan.m)
  y_ref[0] = y.astype(y_ref.dtype)

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    s_ref[0] = state[...]


def _bwd_kernel(x_ref, bd_ref, c_ref, t_ref, rates_ref, weights_ref, start_ref, dy_ref, ds_ref,
                dx_ref, dbd_ref, dc_ref, dt_ref, drates_ref, dweights_ref, ds0_ref, dstate, *,
                plan: TilePlan):
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    dstate[...] = ds_ref[0]
    drates_ref[...] = jnp.zeros_like(drates_ref)
    dweights_ref[...] = jnp.zeros_like(dweights_ref)

  dx, dbd, dc, dt, dmodes, dstate[...] = chunk_backward_stacked(
      x_ref[0], bd_ref[0], c_ref[0], t_ref[0], _modes(rates_ref, weights_ref),
      start_ref[0, 0], dy_ref[0], dstate[...], num_modes=plan.m)
  dx_ref[0], dbd_ref[0], dc_ref[0], dt_ref[0] = dx, dbd, dc, dt
  drates_ref[0] += dmodes.rates
  dweights_ref[0] += dmodes.weights

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    ds0_ref[0] = dstate[...]


def _specs(plan: TilePlan, chunk_index):
  """BlockSpecs of (x, bd, c, t, rates, weights) on the grid (g, i)."""
  tok = lambda w: pl.BlockSpec((1, plan.chunk, w), lambda g, i: (g, chunk_index(i), 0))
  row = pl.BlockSpec((1, 1, plan.m_pad), lambda g, i: (g, 0, 0))
  return [tok(plan.p), tok(plan.n), tok(plan.n), tok(1), row, row]


def _params():
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def forward(plan: TilePlan, _blocks, interpret, x, bd, c, t, modes: Modes, state, *,
            save_starts: bool):
  g, k, n_chunks = x.shape[0], plan.m_pad * plan.n, plan.num_chunks
  whole_state = pl.BlockSpec((1, k, plan.p), lambda g, i: (g, 0, 0))
  out_specs = [pl.BlockSpec((1, plan.chunk, plan.p), lambda g, i: (g, i, 0)), whole_state]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(state.shape, _F32)]
  if save_starts:
    out_specs.append(pl.BlockSpec((1, 1, k, plan.p), lambda g, i: (g, i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((g, n_chunks, k, plan.p), _F32))
  outs = pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan, save_starts=save_starts),
      grid=(g, n_chunks),
      in_specs=_specs(plan, lambda i: i) + [whole_state],
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((k, plan.p), _F32)],
      compiler_params=_params(),
      interpret=interpret,
      name="frac_scan_fwd",
  )(x, bd, c, t, *modes, state)
  return tuple(outs) if save_starts else (*outs, None)


def backward(plan: TilePlan, _blocks, interpret, x, bd, c, t, modes: Modes, starts, dy, dstate):
  g, k, n_chunks = x.shape[0], plan.m_pad * plan.n, plan.num_chunks
  rev = lambda i: n_chunks - 1 - i
  specs = _specs(plan, rev)
  whole_state = pl.BlockSpec((1, k, plan.p), lambda g, i: (g, 0, 0))
  grads = pl.pallas_call(
      functools.partial(_bwd_kernel, plan=plan),
      grid=(g, n_chunks),
      in_specs=specs + [pl.BlockSpec((1, 1, k, plan.p), lambda g, i: (g, rev(i), 0, 0)),
                        specs[0], whole_state],
      out_specs=specs + [whole_state],
      out_shape=[jax.ShapeDtypeStruct(a.shape, _F32) for a in (x, bd, c, t, *modes, dstate)],
      scratch_shapes=[pltpu.VMEM((k, plan.p), _F32)],
      compiler_params=_params(),
      interpret=interpret,
      name="frac_scan_bwd",
  )(x, bd, c, t, *modes, starts, dy, dstate)
  dx, dbd, dc, dt, drates, dweights, ds0 = grads
  return dx, dbd, dc, dt, Modes(drates, dweights), ds0
