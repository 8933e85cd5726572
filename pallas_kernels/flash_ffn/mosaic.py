"""FlashFFN on TPU (Mosaic): the reduction over (expert, d_e tile) is the trailing
"arbitrary" grid axes, accumulated in float32 VMEM scratch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_ffn.tiles import Orientation, TilePlan

_F32 = jnp.float32


def _fwd_kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, acc_ref, *, orient: Orientation):
  e, c = pl.program_id(2), pl.program_id(3)

  @pl.when((e == 0) & (c == 0))
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += orient.forward(q_ref[...], orient.router_weights(r_ref[...], e), k_ref[...],
                                 u_ref[...], v_ref[...])

  @pl.when((e == pl.num_programs(2) - 1) & (c == pl.num_programs(3) - 1))
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _dq_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dq_ref, dr_ref, dq_acc, dr_acc, *,
               orient: Orientation):
  e, c = pl.program_id(2), pl.program_id(3)

  @pl.when((e == 0) & (c == 0))
  def _():
    dq_acc[...] = jnp.zeros_like(dq_acc)
    dr_acc[...] = jnp.zeros_like(dr_acc)

  r = r_ref[...]
  dq, dr_e = orient.dq_dr(q_ref[...], orient.router_weights(r, e), ds_ref[...], k_ref[...],
                          u_ref[...], v_ref[...])
  dq_acc[...] += dq
  dr_acc[...] += dr_e * orient.onehot(e, r.shape)

  @pl.when((e == pl.num_programs(2) - 1) & (c == pl.num_programs(3) - 1))
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
    dr_ref[...] = dr_acc[...]


def _dkuv_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dk_ref, du_ref, dv_ref,
                 dk_acc, du_acc, dv_acc, *, orient: Orientation):
  e, i = pl.program_id(1), pl.program_id(3)

  @pl.when(i == 0)
  def _():
    for acc in (dk_acc, du_acc, dv_acc):
      acc[...] = jnp.zeros_like(acc)

  grads = orient.dkuv(q_ref[...], orient.router_weights(r_ref[...], e), ds_ref[...],
                      k_ref[...], u_ref[...], v_ref[...])
  for acc, g in zip((dk_acc, du_acc, dv_acc), grads):
    acc[...] += g

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    for ref, acc in ((dk_ref, dk_acc), (du_ref, du_acc), (dv_ref, dv_acc)):
      ref[...] = acc[...].astype(ref.dtype)


def _params(*semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


def forward(plan: TilePlan, q, r, k, u, v, interpret):
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter
  tok = lambda h, i, e, c: (h, i)
  tab = lambda h, i, e, c: (h, e, c)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, orient=plan.orient),
      grid=(plan.heads, plan.tokens // bq, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=plan.token_spec(bq, tok),
      out_shape=plan.token_shape(q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, plan.d_h), _F32)],
      compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_fwd",
  )(q, r, k, u, v)


def backward(plan: TilePlan, q, r, r_dkuv, k, u, v, ds, interpret):
  bq, bi, bk = plan.blocks.block_q, plan.blocks.block_inter, plan.blocks.block_q_dkv
  tok = lambda h, i, e, c: (h, i)
  tab = lambda h, i, e, c: (h, e, c)
  dq, dr = pl.pallas_call(
      functools.partial(_dq_kernel, orient=plan.orient),
      grid=(plan.heads, plan.tokens // bq, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient), plan.token_spec(bq, tok)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok, plan.orient)],
      out_shape=[plan.token_shape(q.dtype), plan.router_shape()],
      scratch_shapes=[pltpu.VMEM((bq, plan.d_h), _F32),
                      pltpu.VMEM(plan.router_shape().shape[1:2] + (bq,), _F32)],
      compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_bwd_dq",
  )(q, r, ds, k, u, v)
  # Grid (h, e, c, i): the token axis i is the reduction.
  tok = lambda h, e, c, i: (h, i)
  tab = lambda h, e, c, i: (h, e, c)
  dk, du, dv = pl.pallas_call(
      functools.partial(_dkuv_kernel, orient=plan.orient_dkuv),
      grid=(plan.heads, plan.experts, plan.d_e // bi, plan.tokens // bk),
      in_specs=[plan.token_spec(bk, tok), plan.router_spec(bk, tok, plan.orient_dkuv), plan.token_spec(bk, tok)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.table_spec(bi, tab)] * 3,
      out_shape=[plan.table_shape(k.dtype)] * 3,
      scratch_shapes=[pltpu.VMEM((bi, plan.d_h), _F32)] * 3,
      compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_bwd_dkuv",
  )(q, r_dkuv, ds, k, u, v)
  return dq, dr, dk, du, dv
