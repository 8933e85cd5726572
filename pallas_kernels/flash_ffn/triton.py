"""FlashFFN on GPU (Triton): one program per (head, tile); grid steps cannot carry
state, so the reductions are fori_loops inside the kernel over tiles sliced from refs.
Tiles are oriented so that no register value is ever transposed: [tokens, d_e rows] in
the forward and dq kernels (router [H, T, E_pad]), [d_e rows, tokens] in the dK/dU/dV
kernel (router [H, E_pad, T]). The expert loop runs over the real E only (the router's
columns are padded to a power of two, as Triton blocks must be; padded ones are never read)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from neurips26_jax.pallas_kernels.flash_ffn.tiles import TilePlan

_F32 = jnp.float32


def _loop_tables(n_experts, n_inter, bi, body, init):
  """fori_loop over every (expert e, d_e tile) pair: body(e, rows, carry) -> carry."""
  def over_tiles(e, carry):
    def tile(c, carry):
      return body(e, pl.ds(pl.multiple_of(c * bi, bi), bi), carry)
    return jax.lax.fori_loop(0, n_inter, tile, carry)
  return jax.lax.fori_loop(0, n_experts, over_tiles, init)


def _fwd_kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, *, plan: TilePlan):
  q, r, bi, orient = q_ref[...], r_ref[...], plan.blocks.block_inter, plan.orient

  def body(e, rows, acc):
    return acc + orient.forward(q, orient.router_weights(r, e), k_ref[e, rows, :],
                                u_ref[e, rows, :], v_ref[e, rows, :])

  acc = _loop_tables(plan.experts, plan.d_e // bi, bi, body, jnp.zeros(q.shape, _F32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _dq_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dq_ref, dr_ref, *, plan: TilePlan):
  q, r, ds, bi, orient = q_ref[...], r_ref[...], ds_ref[...], plan.blocks.block_inter, plan.orient

  def body(e, rows, carry):
    dq_acc, dr_acc = carry
    dq, dr_e = orient.dq_dr(q, orient.router_weights(r, e), ds, k_ref[e, rows, :],
                            u_ref[e, rows, :], v_ref[e, rows, :])
    return dq_acc + dq, dr_acc + dr_e * orient.onehot(e, r.shape)

  init = (jnp.zeros(q.shape, _F32), jnp.zeros(r.shape, _F32))
  dq, dr = _loop_tables(plan.experts, plan.d_e // bi, bi, body, init)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dr_ref[...] = dr


def _dkuv_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dk_ref, du_ref, dv_ref, *,
                 plan: TilePlan):
  e, bk, orient = pl.program_id(1), plan.blocks.block_q_dkv, plan.orient_dkuv
  k, u, v = k_ref[...], u_ref[...], v_ref[...]

  def step(i, carry):
    rows = pl.ds(pl.multiple_of(i * bk, bk), bk)
    grads = orient.dkuv(q_ref[rows, :], orient.router_weights(r_ref[:, rows], e),
                        ds_ref[rows, :], k, u, v)
    return tuple(acc + g for acc, g in zip(carry, grads))

  dk, du, dv = jax.lax.fori_loop(0, plan.tokens // bk, step, (jnp.zeros(k.shape, _F32),) * 3)
  for ref, g in ((dk_ref, dk), (du_ref, du), (dv_ref, dv)):
    ref[...] = g.astype(ref.dtype)


def _params(plan: TilePlan, num_warps: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=plan.blocks.num_stages)


def _whole_tables(plan: TilePlan):
  return pl.BlockSpec((None, plan.experts, plan.d_e, plan.d_h), lambda h, i: (h, 0, 0, 0))


def forward(plan: TilePlan, q, r, k, u, v, interpret):
  bq = plan.blocks.block_q
  tok = lambda h, i: (h, i)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan),
      grid=(plan.heads, plan.tokens // bq),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient)] + [_whole_tables(plan)] * 3,
      out_specs=plan.token_spec(bq, tok),
      out_shape=plan.token_shape(q.dtype),
      compiler_params=_params(plan, plan.blocks.num_warps),
      interpret=interpret,
      name="flash_ffn_fwd",
  )(q, r, k, u, v)


def backward(plan: TilePlan, q, r, r_dkuv, k, u, v, ds, interpret):
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter
  tok = lambda h, i: (h, i)
  dq, dr = pl.pallas_call(
      functools.partial(_dq_kernel, plan=plan),
      grid=(plan.heads, plan.tokens // bq),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient), plan.token_spec(bq, tok)]
      + [_whole_tables(plan)] * 3,
      out_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient)],
      out_shape=[plan.token_shape(q.dtype), plan.router_shape()],
      compiler_params=_params(plan, plan.blocks.num_warps),
      interpret=interpret,
      name="flash_ffn_bwd_dq",
  )(q, r, ds, k, u, v)
  # Grid (h, e, c): each program owns one table tile and loops over all tokens.
  all_tok = lambda h, e, c: (h, 0)
  tab = lambda h, e, c: (h, e, c)
  dk, du, dv = pl.pallas_call(
      functools.partial(_dkuv_kernel, plan=plan),
      grid=(plan.heads, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(plan.tokens, all_tok), plan.router_spec(plan.tokens, all_tok, plan.orient_dkuv),
                plan.token_spec(plan.tokens, all_tok)] + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.table_spec(bi, tab)] * 3,
      out_shape=[plan.table_shape(k.dtype)] * 3,
      compiler_params=_params(plan, plan.blocks.num_warps_dkv),
      interpret=interpret,
      name="flash_ffn_bwd_dkuv",
  )(q, r_dkuv, ds, k, u, v)
  return dq, dr, dk, du, dv
