"""Fused multi-head FFN (FlashFFN) as Pallas kernels, forward and backward.

Math and shapes: `jaxops.flash_ffn` (the reference this kernel is tested against).
The kernel never writes the d_ff-wide intermediate to HBM. For one head and one
tile of `block_q` tokens it walks the reduction axis (expert e, d_e tile c)::

  acc = 0                                        # [block_q, d_h] float32, on chip
  for e, c:
    m = q K[e,c]^T ; n = q U[e,c]^T              # [block_q, block_inter]
    acc += (r[:, e] * silu(m) * n) V[e,c]

Backward, recomputing m and n from (q, r, K, U, V) and the output cotangent ds::

  da = ds V^T ;  dr[:, e] = rowsum(da * a)                   a = silu(m) * n
  dm = r da n silu'(m) ;  dn = r da silu(m)                  silu'(x) = sig(x)(1 + x(1 - sig(x)))
  dq = sum_{e,c} dm K + dn U                                 (kernel over query tiles)
  dK = dm^T q ; dU = dn^T q ; dV = (r a)^T ds                (kernel over (e, c), looping over tokens)

Two lowerings of the same tile math:
- Mosaic (TPU): the reduction is a trailing "arbitrary" grid axis with a VMEM
  float32 accumulator.
- Triton (GPU): grid steps cannot carry state, so the reduction is a `fori_loop`
  inside the kernel over tiles sliced from refs. Triton needs power-of-two block
  sizes, so d_h and E are zero-padded to powers of two there (zero tables and zero
  router weights contribute nothing).

`mhffn` is the one public entry point. It dispatches with
`jax.lax.platform_dependent`: Mosaic on TPU, Triton on GPU, the Mosaic kernel in
interpret mode elsewhere (CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxops.flash_ffn import check_mhffn_inputs
from jaxops.tiling import dot, dot_nt, dot_tn, next_pow2, round_up
from pallas_kernels.dispatch import Backend, KernelConfig, dispatch

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes. `block_q`: tokens per tile; `block_inter`: d_e columns per tile.

  Both are upper bounds: small problems use smaller tiles (see `_fit`).
  """

  block_q: int = 256
  block_inter: int = 128
  block_q_dkv: int = 256  # tokens per step of the dK/dU/dV kernel's token loop

  @classmethod
  def for_backend(cls, backend: Backend) -> "BlockSizes":
    if backend == "triton":  # register-file sized tiles for one warp group
      return cls(block_q=64, block_inter=64, block_q_dkv=64)
    return cls()


# ----------------------------------------------------------------------------
# Tile math shared by every kernel and both lowerings.
# ----------------------------------------------------------------------------

def _column(r, e):
  """r[:, e:e+1] for a traced e, as a masked row sum (works in Mosaic and Triton)."""
  cols = jax.lax.broadcasted_iota(jnp.int32, r.shape, 1)
  return jnp.sum(jnp.where(cols == e, r.astype(_F32), 0.0), axis=1, keepdims=True)


def _onehot_row(e, shape):
  cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return (cols == e).astype(_F32)


def _tile_forward(q, r_e, k, u, v):
  """Contribution of one (expert, d_e tile) to the output: [block_q, d_h] f32."""
  m = dot_nt(q, k)
  n = dot_nt(q, u)
  a = m * jax.nn.sigmoid(m) * n * r_e
  return dot(a.astype(v.dtype), v)


def _tile_backward(q, r_e, ds, k, u, v):
  """Recomputes one tile; returns (a, da, dm, dn), all [block_q, block_inter] f32."""
  m = dot_nt(q, k)
  n = dot_nt(q, u)
  sig = jax.nn.sigmoid(m)
  silu = m * sig
  a = silu * n
  da = dot_nt(ds, v)
  g = r_e * da
  dm = g * n * sig * (1.0 + m * (1.0 - sig))
  dn = g * silu
  return a, da, dm, dn


def _tile_dq_dr(q, r_e, ds, k, u, v):
  a, da, dm, dn = _tile_backward(q, r_e, ds, k, u, v)
  dq = dot(dm.astype(k.dtype), k) + dot(dn.astype(u.dtype), u)
  dr_e = jnp.sum(da * a, axis=1, keepdims=True)
  return dq, dr_e


def _tile_dkuv(q, r_e, ds, k, u, v):
  a, _, dm, dn = _tile_backward(q, r_e, ds, k, u, v)
  dk = dot_tn(dm.astype(q.dtype), q)
  du = dot_tn(dn.astype(q.dtype), q)
  dv = dot_tn((r_e * a).astype(ds.dtype), ds)
  return dk, du, dv


# ----------------------------------------------------------------------------
# Layout. Token arrays (q, ds, o, dq) are either "flat" [T, H * d_h], a free reshape
# of [B, L, H, d_h] whose blocks are (tokens, d_h) at column block h, or head-major
# [H, T, d_h] where flat blocks are illegal (Mosaic with d_h % 128 != 0; Triton when
# d_h must be padded to a power of two). Router weights are always head-major
# [H, T, E] (E is small), tables stay [H, E, d_e, d_h]. Inside the kernels every
# block is 2-D: leading block dims are squeezed (None).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Fitted tile sizes, padded extents and token layout for one backend and problem."""

  blocks: BlockSizes
  heads: int
  tokens: int
  d_h: int
  experts: int
  d_e: int
  flat: bool

  @classmethod
  def make(cls, backend: Backend, blocks: BlockSizes, q, k) -> "_Plan":
    batch, length, heads, d_h = q.shape
    experts, d_e = k.shape[1:3]
    tokens = batch * length
    if backend == "triton":  # power-of-two tiles, >= 16 for tl.dot
      fit_tok = lambda b: min(b, next_pow2(tokens))
      bi = min(blocks.block_inter, next_pow2(d_e))
      padded_d_h, experts = next_pow2(d_h), next_pow2(experts, minimum=1)
      flat = padded_d_h == d_h
    else:  # Mosaic: second-minor block dims multiples of 8, minor ones of 128
      fit_tok = lambda b: min(b, round_up(tokens, 8))
      bi = min(blocks.block_inter, d_e)
      padded_d_h, flat = d_h, d_h % 128 == 0 or heads == 1
    bq, bk = fit_tok(blocks.block_q), fit_tok(blocks.block_q_dkv)
    tile = max(bq, bk)
    if tile % bq or tile % bk:
      raise ValueError(f"block_q ({bq}) and block_q_dkv ({bk}) must divide one another")
    return cls(BlockSizes(bq, bi, bk), heads, round_up(tokens, tile), padded_d_h, experts,
               round_up(d_e, bi), flat)

  # Array layout in and out of the kernels.

  def _tokens_first(self, x, width: int):
    """[B, L, H, X] -> [T, H, width], zero-padded."""
    b, l, h, x_width = x.shape
    return jnp.pad(x.reshape(b * l, h, x_width),
                   ((0, self.tokens - b * l), (0, 0), (0, width - x_width)))

  def tokens_in(self, x):
    """q-like [B, L, H, d_h] -> kernel layout."""
    x = self._tokens_first(x, self.d_h)
    return x.reshape(self.tokens, -1) if self.flat else jnp.moveaxis(x, 1, 0)

  def tokens_out(self, x, like):
    b, l, h, width = like.shape
    x = x.reshape(self.tokens, h, self.d_h) if self.flat else jnp.moveaxis(x, 0, 1)
    return x[:b * l, :, :width].reshape(like.shape)

  def router_in(self, r):
    return jnp.moveaxis(self._tokens_first(r, self.experts), 1, 0)

  def router_out(self, dr, like):
    b, l, h, e = like.shape
    return jnp.moveaxis(dr[:, :b * l, :e], 0, 1).reshape(like.shape)

  def table_in(self, t):
    return jnp.pad(t, ((0, 0), (0, self.experts - t.shape[1]), (0, self.d_e - t.shape[2]),
                       (0, self.d_h - t.shape[3])))

  @staticmethod
  def table_out(t, like):
    _, e, f, d = like.shape
    return t[:, :e, :f, :d]

  def token_shape(self, dtype):
    shape = (self.tokens, self.heads * self.d_h) if self.flat else (self.heads, self.tokens,
                                                                     self.d_h)
    return jax.ShapeDtypeStruct(shape, dtype)

  # Block specs; `where(*grid) -> (h, i)` or `(h, e, c)` picks the block.

  def token_spec(self, rows: int, where):
    if self.flat:
      return pl.BlockSpec((rows, self.d_h), lambda *g: where(*g)[::-1])
    return pl.BlockSpec((None, rows, self.d_h), lambda *g: (*where(*g), 0))

  def router_spec(self, rows: int, where):
    return pl.BlockSpec((None, rows, self.experts), lambda *g: (*where(*g), 0))

  def table_spec(self, rows: int, where):
    return pl.BlockSpec((None, None, rows, self.d_h), lambda *g: (*where(*g), 0))


# ----------------------------------------------------------------------------
# Mosaic (TPU) kernels: the reduction is the trailing grid axes, accumulated in
# float32 VMEM scratch.
# ----------------------------------------------------------------------------

def _mosaic_fwd_kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, acc_ref):
  e, c = pl.program_id(2), pl.program_id(3)

  @pl.when((e == 0) & (c == 0))
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += _tile_forward(q_ref[...], _column(r_ref[...], e), k_ref[...], u_ref[...],
                                v_ref[...])

  @pl.when((e == pl.num_programs(2) - 1) & (c == pl.num_programs(3) - 1))
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _mosaic_dq_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dq_ref, dr_ref,
                      dq_acc, dr_acc):
  e, c = pl.program_id(2), pl.program_id(3)

  @pl.when((e == 0) & (c == 0))
  def _():
    dq_acc[...] = jnp.zeros_like(dq_acc)
    dr_acc[...] = jnp.zeros_like(dr_acc)

  r = r_ref[...]
  dq, dr_e = _tile_dq_dr(q_ref[...], _column(r, e), ds_ref[...], k_ref[...], u_ref[...],
                         v_ref[...])
  dq_acc[...] += dq
  dr_acc[...] += dr_e * _onehot_row(e, r.shape)

  @pl.when((e == pl.num_programs(2) - 1) & (c == pl.num_programs(3) - 1))
  def _():
    dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
    dr_ref[...] = dr_acc[...].astype(dr_ref.dtype)


def _mosaic_dkuv_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dk_ref, du_ref, dv_ref,
                        dk_acc, du_acc, dv_acc):
  e, i = pl.program_id(1), pl.program_id(3)

  @pl.when(i == 0)
  def _():
    for acc in (dk_acc, du_acc, dv_acc):
      acc[...] = jnp.zeros_like(acc)

  grads = _tile_dkuv(q_ref[...], _column(r_ref[...], e), ds_ref[...], k_ref[...], u_ref[...],
                     v_ref[...])
  for acc, g in zip((dk_acc, du_acc, dv_acc), grads):
    acc[...] += g

  @pl.when(i == pl.num_programs(3) - 1)
  def _():
    for ref, acc in ((dk_ref, dk_acc), (du_ref, du_acc), (dv_ref, dv_acc)):
      ref[...] = acc[...].astype(ref.dtype)


def _mosaic_params(*semantics):
  return pltpu.CompilerParams(dimension_semantics=semantics)


def _mosaic_forward(plan: _Plan, q, r, k, u, v, interpret):
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter
  tok = lambda h, i, e, c: (h, i)
  tab = lambda h, i, e, c: (h, e, c)
  return pl.pallas_call(
      _mosaic_fwd_kernel,
      grid=(plan.heads, plan.tokens // bq, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=plan.token_spec(bq, tok),
      out_shape=plan.token_shape(q.dtype),
      scratch_shapes=[pltpu.VMEM((bq, plan.d_h), _F32)],
      compiler_params=_mosaic_params("parallel", "parallel", "arbitrary", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_fwd",
  )(q, r, k, u, v)


def _mosaic_backward(plan: _Plan, q, r, k, u, v, ds, interpret):
  bq, bi, bk = plan.blocks.block_q, plan.blocks.block_inter, plan.blocks.block_q_dkv
  tok = lambda h, i, e, c: (h, i)
  tab = lambda h, i, e, c: (h, e, c)
  dq, dr = pl.pallas_call(
      _mosaic_dq_kernel,
      grid=(plan.heads, plan.tokens // bq, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok), plan.token_spec(bq, tok)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok)],
      out_shape=[plan.token_shape(q.dtype), jax.ShapeDtypeStruct(r.shape, r.dtype)],
      scratch_shapes=[pltpu.VMEM((bq, plan.d_h), _F32), pltpu.VMEM((bq, plan.experts), _F32)],
      compiler_params=_mosaic_params("parallel", "parallel", "arbitrary", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_bwd_dq",
  )(q, r, ds, k, u, v)
  # Grid (h, e, c, i): the token axis i is the reduction.
  tok = lambda h, e, c, i: (h, i)
  tab = lambda h, e, c, i: (h, e, c)
  dk, du, dv = pl.pallas_call(
      _mosaic_dkuv_kernel,
      grid=(plan.heads, plan.experts, plan.d_e // bi, plan.tokens // bk),
      in_specs=[plan.token_spec(bk, tok), plan.router_spec(bk, tok), plan.token_spec(bk, tok)]
      + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.table_spec(bi, tab)] * 3,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 3,
      scratch_shapes=[pltpu.VMEM((bi, plan.d_h), _F32)] * 3,
      compiler_params=_mosaic_params("parallel", "parallel", "parallel", "arbitrary"),
      interpret=interpret,
      name="flash_ffn_bwd_dkuv",
  )(q, r, ds, k, u, v)
  return dq, dr, dk, du, dv


# ----------------------------------------------------------------------------
# Triton (GPU) kernels: one program per (head, tile); grid steps cannot carry
# state, so reductions are fori_loops inside the kernel over tiles sliced from refs.
# ----------------------------------------------------------------------------

def _loop_tables(n_experts, n_inter, bi, body, init):
  """fori_loop over every (expert e, d_e tile) pair: body(e, rows, carry) -> carry."""
  def over_tiles(e, carry):
    def tile(c, carry):
      return body(e, pl.ds(pl.multiple_of(c * bi, bi), bi), carry)
    return jax.lax.fori_loop(0, n_inter, tile, carry)
  return jax.lax.fori_loop(0, n_experts, over_tiles, init)


def _triton_fwd_kernel(q_ref, r_ref, k_ref, u_ref, v_ref, o_ref, *, bi, n_inter):
  q, r = q_ref[...], r_ref[...]

  def body(e, rows, acc):
    return acc + _tile_forward(q, _column(r, e), k_ref[e, rows, :], u_ref[e, rows, :],
                               v_ref[e, rows, :])

  acc = _loop_tables(r.shape[1], n_inter, bi, body, jnp.zeros(q.shape, _F32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _triton_dq_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dq_ref, dr_ref, *, bi,
                      n_inter):
  q, r, ds = q_ref[...], r_ref[...], ds_ref[...]

  def body(e, rows, carry):
    dq_acc, dr_acc = carry
    dq, dr_e = _tile_dq_dr(q, _column(r, e), ds, k_ref[e, rows, :], u_ref[e, rows, :],
                           v_ref[e, rows, :])
    return dq_acc + dq, dr_acc + dr_e * _onehot_row(e, r.shape)

  init = (jnp.zeros(q.shape, _F32), jnp.zeros(r.shape, _F32))
  dq, dr = _loop_tables(r.shape[1], n_inter, bi, body, init)
  dq_ref[...] = dq.astype(dq_ref.dtype)
  dr_ref[...] = dr.astype(dr_ref.dtype)


def _triton_dkuv_kernel(q_ref, r_ref, ds_ref, k_ref, u_ref, v_ref, dk_ref, du_ref, dv_ref, *,
                        bk, n_tok):
  e = pl.program_id(1)
  k, u, v = k_ref[...], u_ref[...], v_ref[...]

  def step(i, carry):
    rows = pl.ds(pl.multiple_of(i * bk, bk), bk)
    grads = _tile_dkuv(q_ref[rows, :], _column(r_ref[rows, :], e), ds_ref[rows, :], k, u, v)
    return tuple(acc + g for acc, g in zip(carry, grads))

  dk, du, dv = jax.lax.fori_loop(0, n_tok, step, (jnp.zeros(k.shape, _F32),) * 3)
  for ref, g in ((dk_ref, dk), (du_ref, du), (dv_ref, dv)):
    ref[...] = g.astype(ref.dtype)


_TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=2)


def _whole_tables(plan: _Plan):
  return pl.BlockSpec((None, plan.experts, plan.d_e, plan.d_h), lambda h, i: (h, 0, 0, 0))


def _triton_forward(plan: _Plan, q, r, k, u, v, interpret):
  bq, bi = plan.blocks.block_q, plan.blocks.block_inter
  tok = lambda h, i: (h, i)
  return pl.pallas_call(
      functools.partial(_triton_fwd_kernel, bi=bi, n_inter=plan.d_e // bi),
      grid=(plan.heads, plan.tokens // bq),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok)] + [_whole_tables(plan)] * 3,
      out_specs=plan.token_spec(bq, tok),
      out_shape=plan.token_shape(q.dtype),
      compiler_params=_TRITON_PARAMS,
      interpret=interpret,
      name="flash_ffn_fwd",
  )(q, r, k, u, v)


def _triton_backward(plan: _Plan, q, r, k, u, v, ds, interpret):
  bq, bi, bk = plan.blocks.block_q, plan.blocks.block_inter, plan.blocks.block_q_dkv
  tok = lambda h, i: (h, i)
  dq, dr = pl.pallas_call(
      functools.partial(_triton_dq_kernel, bi=bi, n_inter=plan.d_e // bi),
      grid=(plan.heads, plan.tokens // bq),
      in_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok), plan.token_spec(bq, tok)]
      + [_whole_tables(plan)] * 3,
      out_specs=[plan.token_spec(bq, tok), plan.router_spec(bq, tok)],
      out_shape=[plan.token_shape(q.dtype), jax.ShapeDtypeStruct(r.shape, r.dtype)],
      compiler_params=_TRITON_PARAMS,
      interpret=interpret,
      name="flash_ffn_bwd_dq",
  )(q, r, ds, k, u, v)
  # Grid (h, e, c): each program owns one table tile and loops over all tokens.
  all_tok = lambda h, e, c: (h, 0)
  tab = lambda h, e, c: (h, e, c)
  dk, du, dv = pl.pallas_call(
      functools.partial(_triton_dkuv_kernel, bk=bk, n_tok=plan.tokens // bk),
      grid=(plan.heads, plan.experts, plan.d_e // bi),
      in_specs=[plan.token_spec(plan.tokens, all_tok), plan.router_spec(plan.tokens, all_tok),
                plan.token_spec(plan.tokens, all_tok)] + [plan.table_spec(bi, tab)] * 3,
      out_specs=[plan.table_spec(bi, tab)] * 3,
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 3,
      compiler_params=_TRITON_PARAMS,
      interpret=interpret,
      name="flash_ffn_bwd_dkuv",
  )(q, r, ds, k, u, v)
  return dq, dr, dk, du, dv


_KERNELS = {
    "mosaic": (_mosaic_forward, _mosaic_backward),
    "triton": (_triton_forward, _triton_backward),
}


def _forward(backend: Backend, interpret, blocks: BlockSizes, q, r, k, u, v):
  plan = _Plan.make(backend, blocks, q, k)
  o = _KERNELS[backend][0](plan, plan.tokens_in(q), plan.router_in(r),
                           *(plan.table_in(t) for t in (k, u, v)), interpret)
  return plan.tokens_out(o, q)


def _backward(backend: Backend, interpret, blocks: BlockSizes, q, r, k, u, v, ds):
  plan = _Plan.make(backend, blocks, q, k)
  dq, dr, dk, du, dv = _KERNELS[backend][1](
      plan, plan.tokens_in(q), plan.router_in(r), *(plan.table_in(t) for t in (k, u, v)),
      plan.tokens_in(ds.astype(q.dtype)), interpret)
  return (plan.tokens_out(dq, q), plan.router_out(dr, r),
          *(plan.table_out(t, k) for t in (dk, du, dv)))


# ----------------------------------------------------------------------------
# Dispatch and autodiff.
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mhffn(q, r, k, u, v, cfg: KernelConfig):
  return dispatch(_forward, cfg, q, r, k, u, v)


def _mhffn_fwd(q, r, k, u, v, cfg):
  return _mhffn(q, r, k, u, v, cfg), (q, r, k, u, v)


def _mhffn_bwd(cfg, residuals, ds):
  return dispatch(_backward, cfg, *residuals, ds)


_mhffn.defvjp(_mhffn_fwd, _mhffn_bwd)


def mhffn(q, r, k, u, v, *, interpret=None, backend: Backend | None = None, **block_sizes):
  """Fused multi-head FFN, differentiable in all five inputs.

  Args:
    q: [B, L, H, d_h] per-head inputs (float32 or bfloat16).
    r: [B, L, H, E] normalized router weights.
    k, u, v: [H, E, d_e, d_h] gate / up / down tables.
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Triton);
      True (or a `pltpu.InterpretParams`) interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic" or "triton"); with `interpret` this runs the
      other platform's kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (block_q, block_inter, block_q_dkv).

  Returns:
    o: [B, L, H, d_h] in q.dtype; matmuls in the input dtype with float32 accumulation.
  """
  check_mhffn_inputs(q, r, k, u, v)
  cfg = KernelConfig.make("mhffn", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes)
  return _mhffn(q, r, k, u, v, cfg)
