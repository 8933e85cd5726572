"""FlashFFN on TPU (Mosaic): one grid step per (head, token tile, expert group).

A step holds a whole expert group's tables in VMEM (normally every expert of the head, so
a head's tables are read from HBM once: a block whose index does not change between steps
is not fetched again) and walks its (expert, d_e tile) pairs in an unrolled loop. A grid
step costs ~600-1,200 cycles of its own in libtpu's static schedule, so one step per
(expert, d_e tile) paid it 11x per token tile at the paper's shape (~51% of the v5e MXU
peak, against ~94% now: the repository's benchmarks/README.md, `make perf-tpu`).

Tiles are [bq tokens, bi table rows]: the scores q K^T contract both operands' minor dim
and o += a V is a plain product, the two forms the MXU takes without a transpose. The
router block is [E, bq] (tokens on lanes, see `tiles.TilePlan`), turned into per-expert
columns once per token tile.

The backward is one kernel of 8 matmul units per tile (recompute m = q K^T, n = q U^T and
da = ds V^T; dq = dm K + dn U; dK, dU, dV) whose grid runs the token tiles innermost: dq
and dr of a token tile are complete when its step ends, and dK, dU, dV accumulate in VMEM
across the token tiles. Where d_h and bi are multiples of 128 (the paper's shapes) they
accumulate transposed, dK^T += q^T dm, again a plain product (q^T and ds^T are transposed
once per token tile, the accumulators once per head); otherwise as dm^T q, a transposed
operand Mosaic lowers itself.

silu(m) = m sigmoid(m) with sigmoid(m) = (1 + tanh(m / 2)) / 2 (`tiles.tanh_sigmoid`):
exact, and one transcendental per element where exp and a reciprocal are two.

The routed kernels (`Router`, the layer's) read the tables as stored, float32, and copy each
head's into VMEM once, in q's dtype with the norm gain folded in: no cast or scaled copy of a
table goes through HBM, nor is kept for the backward (bf16, 16k tokens: the layer's fwd+bwd
temporaries 82 -> 65 MiB on v5e). That copy needs its head's token tiles in order, so their
grid axis is "arbitrary" there.

When a head's tables exceed the VMEM budget (`tiles.mosaic_experts_per_step`), experts come
in groups of a multiple of 8 (the router block's sublane rows): the forward reduces over the
groups in an "arbitrary" grid axis, and the backward writes one float32 dq per group,
summed in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from neurips26_jax.jaxops.flash_ffn import NORM_EPS
from neurips26_jax.jaxops.tiling import dot, dot_nt, dot_tn, round_up
from neurips26_jax.pallas_kernels.flash_ffn.blocks import mosaic_vmem_limit
from neurips26_jax.pallas_kernels.flash_ffn.tiles import (TilePlan, activation_grads, tanh_sigmoid,
                                                          weighted_activation)

_F32 = jnp.float32
# d_e tiles of one expert unrolled up to this many; longer loops keep one body.
_UNROLL = 4


def _transposed_grads(plan: TilePlan) -> bool:
  """Whether dK, dU, dV accumulate as [d_h, rows] tiles (lane-aligned transposes)."""
  return plan.d_h % 128 == 0 and plan.blocks.block_inter % 128 == 0


def _router_columns(r):
  """Router block [rows, bq] -> float32 [bq, rows padded to 8] (aligned for the transpose)."""
  pad = round_up(r.shape[0], 8) - r.shape[0]
  if pad:
    r = jnp.concatenate([r, jnp.zeros((pad, r.shape[1]), r.dtype)], axis=0)
  return r.astype(_F32).T


def _router_rows(columns, rows: int):
  """Per-expert columns [bq, 1] -> the router block's form [rows, bq]."""
  pad = round_up(rows, 8) - len(columns)
  block = jnp.concatenate(columns + [jnp.zeros_like(columns[0])] * pad, axis=1)
  return block.T[:rows]


def _over_tiles(plan: TilePlan, body, carry):
  """carry <- body(rows, carry) over one expert's d_e tiles (`rows` a pl.ds of table rows):
  unrolled up to _UNROLL tiles, else a loop."""
  bi = plan.blocks.block_inter
  tiles = plan.d_e // bi
  if tiles <= _UNROLL:
    for c in range(tiles):
      carry = body(pl.ds(c * bi, bi), carry)
    return carry
  return jax.lax.fori_loop(
      0, tiles, lambda c, carry: body(pl.ds(pl.multiple_of(c * bi, bi), bi), carry), carry)


@dataclasses.dataclass(frozen=True)
class Router:
  """The head norm and router computed inside the kernels (`mhffn_routed`): the router block
  is the head's W_r [d_h, E padded to 128 lanes] in q's dtype instead of the weights r.

  The routed kernels also take the tables as stored (float32 parameters) with the norm gain
  g [H, 1, d_h] float32, and stage each head's tables into VMEM once, in q's dtype with g
  folded into K and U (`_stage_tables`); the backward returns the gradients of the stored
  tables and g's share from them (`_table_grads`)."""

  normalize: bool
  experts: int


def _route(q, w_r, router: Router):
  """One token tile's (q_hat, r [bq, lanes] float32, state for `_route_grads`): q_hat = q /
  rms(q) if normalizing, r = sigmoid(q_hat W_r) / max(sum, 1e-20) over the real experts (the
  padding lanes are 0), as `jaxops.flash_ffn.route_heads` computes them."""
  rstd = None
  if router.normalize:
    q32 = q.astype(_F32)
    rstd = jax.lax.rsqrt(jnp.mean(q32 * q32, axis=1, keepdims=True) + NORM_EPS)
    q = (q32 * rstd).astype(q.dtype)
  lanes = jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], w_r.shape[1]), 1)
  sig = jnp.where(lanes < router.experts, jax.nn.sigmoid(dot(q, w_r)), 0.0)
  total = jnp.sum(sig, axis=1, keepdims=True)
  return q, sig / jnp.maximum(total, 1e-20), (rstd, sig, total)


def _route_grads(dq_hat, dr, q_hat, w_r, state, router: Router):
  """(dq, dz): the cotangent of the kernel's raw q from that of q_hat and the router weights'
  dr [bq, lanes], through the router (r = sig / max(S, 1e-20), S = sum sig, sig = sigmoid(z))
  and the norm (dq = rstd (dq_hat - q_hat mean(dq_hat q_hat))); dz [bq, lanes] gives dW_r."""
  rstd, sig, total = state
  denominator = jnp.maximum(total, 1e-20)
  r = sig / denominator
  shared = jnp.where(total > 1e-20, jnp.sum(dr * r, axis=1, keepdims=True), 0.0)
  dz = (dr - shared) / denominator * sig * (1.0 - sig)
  dq_hat = dq_hat + dot_nt(dz.astype(q_hat.dtype), w_r)
  if not router.normalize:
    return dq_hat, dz
  y = q_hat.astype(_F32)
  return rstd * (dq_hat - y * jnp.mean(dq_hat * y, axis=1, keepdims=True)), dz


def _stage_tables(raw, gain_ref, staged):
  """Copy one head's tables (k, u, v refs in their stored dtype) into the VMEM scratch
  `staged` in q's dtype, with K and U scaled by the norm gain: q_hat g K^T = q_hat (K g)^T.

  Once per head, at its first token tile: XLA would otherwise write the three folded and
  cast tables to HBM before the kernels, and the layer would keep them for the backward."""
  g = gain_ref[...].astype(_F32)
  for src, dst, folded in zip(raw, staged, (True, True, False)):
    for e in range(src.shape[0]):
      t = src[e].astype(_F32)
      dst[e] = (t * g if folded else t).astype(dst.dtype)


def _table_grads(grads, raw, gain_ref, dgain_ref):
  """Gradients of the folded tables (float32 [E, d_e, d_h] each, K's, U's, V's) -> those of
  the stored tables (dK = dK_g g, dU = dU_g g) and of g (sum of dK_g K + dU_g U over experts
  and rows), written to dgain_ref [1, d_h]; returns the three table gradients."""
  g = gain_ref[...].astype(_F32)
  dgain = jnp.zeros(g.shape, _F32)
  out = []
  for grad, src, folded in zip(grads, raw, (True, True, False)):
    if folded:
      dgain = dgain + sum(jnp.sum(grad[e] * src[e].astype(_F32), axis=0, keepdims=True)
                          for e in range(len(grad)))
      grad = [x * g for x in grad]
    out.append(grad)
  dgain_ref[...] = dgain
  return out


def _inputs(q_ref, r_ref, router: Router | None):
  """(q_hat, router columns [bq, >= E], state): the router block as it comes, or routed."""
  if router is None:
    return q_ref[...], _router_columns(r_ref[...]), None
  return _route(q_ref[...], r_ref[...], router)


def _fwd_kernel(q_ref, r_ref, *refs, plan: TilePlan, router: Router | None):
  """refs: (k, u, v, o, acc) or, routed, (gain, k, u, v, o, acc, staged k, u, v)."""
  if router is None:
    k_ref, u_ref, v_ref, o_ref, acc_ref = refs
  else:
    gain_ref, raw = refs[0], refs[1:4]
    (o_ref, acc_ref), (k_ref, u_ref, v_ref) = refs[4:6], refs[6:]

    @pl.when(pl.program_id(1) == 0)
    def _():
      _stage_tables(raw, gain_ref, (k_ref, u_ref, v_ref))

  g = pl.program_id(2)

  @pl.when(g == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  q, r, _ = _inputs(q_ref, r_ref, router)
  for e in range(plan.experts_per_step):
    def tile(rows, carry, e=e):
      k, u, v = k_ref[e, rows, :], u_ref[e, rows, :], v_ref[e, rows, :]
      a = weighted_activation(dot_nt(q, k), dot_nt(q, u), r[:, e:e + 1],
                              sigmoid=tanh_sigmoid)
      acc_ref[...] += dot(a.astype(v.dtype), v)
      return carry
    _over_tiles(plan, tile, ())

  @pl.when(g == pl.num_programs(2) - 1)
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _bwd_kernel(q_ref, r_ref, ds_ref, *refs, plan: TilePlan, router: Router | None):
  """refs: (k, u, v, dq, dr, dk, du, dv, dK acc, dU acc, dV acc) or, routed, (gain, k, u, v,
  dq, dW_r, dk, du, dv, dgain, the three accs, dW_r acc, staged k, u, v). dr_ref is dr [rows,
  bq] (router weights given) or dW_r [d_h, lanes] (routed), which accumulates across the token
  tiles in its acc like dK, dU, dV."""
  i = pl.program_id(2)
  if router is None:
    k_ref, u_ref, v_ref, dq_ref, dr_ref, dk_ref, du_ref, dv_ref, *accs = refs
  else:
    gain_ref, raw = refs[0], refs[1:4]
    dq_ref, dr_ref, dk_ref, du_ref, dv_ref, dgain_ref = refs[4:10]
    accs, (k_ref, u_ref, v_ref) = refs[10:14], refs[14:]

    @pl.when(i == 0)
    def _():
      _stage_tables(raw, gain_ref, (k_ref, u_ref, v_ref))

  dk_acc, du_acc, dv_acc, *router_acc = accs
  outs = (dk_ref, du_ref, dv_ref)

  @pl.when(i == 0)
  def _():
    for acc in accs:
      acc[...] = jnp.zeros_like(acc)

  q, r, state = _inputs(q_ref, r_ref, router)
  ds = ds_ref[...]
  transposed = _transposed_grads(plan)
  if transposed:
    q_t, ds_t = q.T, ds.T
  dq = jnp.zeros(q.shape, _F32)
  dr = []
  for e in range(plan.experts_per_step):
    r_e = r[:, e:e + 1]

    def tile(rows, carry, e=e, r_e=r_e):
      dq, dr_e = carry
      k, u, v = k_ref[e, rows, :], u_ref[e, rows, :], v_ref[e, rows, :]
      m, n, da = dot_nt(q, k), dot_nt(q, u), dot_nt(ds, v)
      a, dm, dn = activation_grads(m, n, da, r_e, sigmoid=tanh_sigmoid)
      dr_e = dr_e + jnp.sum(da * a, axis=1, keepdims=True)
      dm, dn, ra = dm.astype(q.dtype), dn.astype(q.dtype), (r_e * a).astype(ds.dtype)
      dq = dq + dot(dm, k) + dot(dn, u)
      if transposed:
        for acc, x_t, y in ((dk_acc, q_t, dm), (du_acc, q_t, dn), (dv_acc, ds_t, ra)):
          acc[e, :, rows] += dot(x_t, y)
      else:
        for acc, y, x in ((dk_acc, dm, q), (du_acc, dn, q), (dv_acc, ra, ds)):
          acc[e, rows, :] += dot_tn(y, x)
      return dq, dr_e

    dq, dr_e = _over_tiles(plan, tile, (dq, jnp.zeros((q.shape[0], 1), _F32)))
    dr.append(dr_e)
  if router is None:
    dr_ref[...] = _router_rows(dr, dr_ref.shape[0])
  else:
    lanes = r.shape[1]
    dr = jnp.concatenate(dr + [jnp.zeros((q.shape[0], lanes - len(dr)), _F32)], axis=1)
    dq, dz = _route_grads(dq, dr, q, r_ref[...], state, router)
    router_acc[0][...] += dot(q_t, dz) if transposed else dot_tn(q, dz)
  dq_ref[...] = dq.astype(dq_ref.dtype)

  @pl.when(i == pl.num_programs(2) - 1)
  def _():
    grads = [[acc[e].T if transposed else acc[e] for e in range(plan.experts_per_step)]
             for acc in accs[:3]]
    if router is not None:
      grads = _table_grads(grads, raw, gain_ref, dgain_ref)
      dr_ref[...] = router_acc[0][...]
    for out, grad in zip(outs, grads):
      for e, x in enumerate(grad):
        out[e] = x.astype(out.dtype)


def _params(plan: TilePlan, *semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics,
                              vmem_limit_bytes=mosaic_vmem_limit())


def _router_block(plan: TilePlan, tokens: int, where):
  """Router / dr blocks [experts of the group, tokens] of [H, E, T]; where(*grid) -> (h, g, i)."""
  rows = plan.experts_per_step if plan.groups > 1 else plan.experts_pad
  return pl.BlockSpec((None, rows, tokens), lambda *grid: where(*grid))


def _table_block(plan: TilePlan, where):
  """One expert group's tables [E_t, d_e, d_h]; where(*grid) -> (h, g)."""
  return pl.BlockSpec((None, plan.experts_per_step, plan.d_e, plan.d_h),
                      lambda *grid: (*where(*grid), 0, 0))


def _router_table_block(w_r):
  """The routed kernels' W_r [H, d_h, lanes]: one head's per step."""
  return pl.BlockSpec((None, *w_r.shape[1:]), lambda h, *_: (h, 0, 0))


def _gain_block(plan: TilePlan):
  """The routed kernels' norm gain [H, 1, d_h]: one head's per step."""
  return pl.BlockSpec((None, 1, plan.d_h), lambda h, *_: (h, 0, 0))


def _staged(plan: TilePlan, dtype):
  """VMEM for one head's tables in the compute dtype (`_stage_tables`)."""
  return [pltpu.VMEM((plan.experts_per_step, plan.d_e, plan.d_h), dtype)] * 3


def forward(plan: TilePlan, q, r, k, u, v, interpret, router: Router | None = None,
            gain=None):
  """o in the kernel layout; with `router`, r is W_r [H, d_h, lanes] and gain [H, 1, d_h]
  (see `Router`)."""
  bq = plan.blocks.block_q
  tok = lambda h, i, g: (h, i)
  table = _table_block(plan, lambda h, i, g: (h, g))
  if router is None:
    r_spec, gains, extra, scratch = (_router_block(plan, bq, lambda h, i, g: (h, g, i)), [], [],
                                     [])
  else:
    r_spec, gains, extra = _router_table_block(r), [_gain_block(plan)], [gain]
    scratch = _staged(plan, q.dtype)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, plan=plan, router=router),
      grid=(plan.heads, plan.tokens // bq, plan.groups),
      in_specs=[plan.token_spec(bq, tok), r_spec, *gains] + [table] * 3,
      out_specs=plan.token_spec(bq, tok),
      out_shape=plan.token_shape(q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, plan.d_h), _F32)] + scratch,
      # Routed: a head's first token tile stages its tables for the others (sequential).
      compiler_params=_params(plan, "parallel", "arbitrary" if router else "parallel",
                              "arbitrary"),
      interpret=interpret,
      name="flash_ffn_fwd",
  )(q, r, *extra, k, u, v)


def _group_token_spec(plan: TilePlan, rows: int):
  """Per-group float32 dq partials [G, T, H d_h] (flat) or [G, H, T, d_h]; grid (h, g, i)."""
  if plan.flat:
    return pl.BlockSpec((None, rows, plan.d_h), lambda h, g, i: (g, i, h))
  return pl.BlockSpec((None, None, rows, plan.d_h), lambda h, g, i: (g, h, i, 0))


def backward(plan: TilePlan, q, r, r_dkuv, k, u, v, ds, interpret, router: Router | None = None,
             gain=None):
  """(dq, dr, dk, du, dv) in the kernel layout; r_dkuv is r (one router layout on TPU). With
  `router`, r is W_r and gain [H, 1, d_h], and the result is (dq, dW_r [H, d_h, lanes]
  float32, dk, du, dv in the tables' dtype, dgain [H, 1, d_h] float32) (see `Router`)."""
  del r_dkuv
  bk, groups = plan.blocks.block_q_dkv, plan.groups
  if router is not None and groups > 1:
    raise ValueError("mhffn: the routed kernels need a head's tables in one expert group")
  tok = lambda h, g, i: (h, i)
  table = _table_block(plan, lambda h, g, i: (h, g))
  acc = (plan.experts_per_step,) + ((plan.d_h, plan.d_e) if _transposed_grads(plan)
                                    else (plan.d_e, plan.d_h))
  if groups == 1:
    dq_spec, dq_shape = plan.token_spec(bk, tok), plan.token_shape(q.dtype)
  else:
    dq_spec = _group_token_spec(plan, bk)
    dq_shape = jax.ShapeDtypeStruct((groups,) + plan.token_shape(q.dtype).shape, _F32)
  if router is None:
    r_spec = dr_spec = _router_block(plan, bk, lambda h, g, i: (h, g, i))
    dr_shape, gains, extra, outs, scratch = plan.router_shape(), [], [], [], []
  else:
    r_spec = dr_spec = _router_table_block(r)
    dr_shape, gains, extra = jax.ShapeDtypeStruct(r.shape, _F32), [_gain_block(plan)], [gain]
    outs = [(_gain_block(plan), jax.ShapeDtypeStruct(gain.shape, _F32))]
    scratch = [pltpu.VMEM(r.shape[1:], _F32)] + _staged(plan, q.dtype)
  results = pl.pallas_call(
      functools.partial(_bwd_kernel, plan=plan, router=router),
      grid=(plan.heads, groups, plan.tokens // bk),
      in_specs=[plan.token_spec(bk, tok), r_spec, plan.token_spec(bk, tok), *gains, table,
                table, table],
      out_specs=[dq_spec, dr_spec] + [table] * 3 + [spec for spec, _ in outs],
      out_shape=([dq_shape, dr_shape] + [plan.table_shape(k.dtype)] * 3
                 + [shape for _, shape in outs]),
      scratch_shapes=[pltpu.VMEM(acc, _F32)] * 3 + scratch,
      compiler_params=_params(plan, "parallel", "parallel", "arbitrary"),
      # dq overwrites ds: a token tile's step reads its ds block before its dq block is
      # written, and no other step reads it (one [L, d] buffer less in the layer's backward).
      input_output_aliases={2: 0} if groups == 1 else {},
      interpret=interpret,
      name="flash_ffn_bwd",
  )(q, r, ds, *extra, k, u, v)
  dq, *rest = results
  if groups > 1:
    dq = jnp.sum(dq, axis=0).astype(q.dtype)
  return (dq, *rest)
