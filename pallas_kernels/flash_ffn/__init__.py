"""Fused multi-head FFN (FlashFFN) as Pallas kernels, forward and backward.

Math and shapes: `jaxops.flash_ffn` (the reference this kernel is tested against). The
kernels never write the d_ff-wide intermediate to HBM: for one head and one tile of
tokens they walk the reduction axis (expert e, d_e tile c) keeping a [tokens, d_h]
float32 accumulator on chip (tile math in `tiles.py`). Backward recomputes the tile from
(q, r, K, U, V) and the output cotangent: one kernel over token tiles gives dq and dr,
one over (e, c) tiles loops over all tokens for dK, dU, dV.

Files: `blocks.py` (tile sizes and the per-chip tuned table), `tiles.py` (tile math and
the tile plan, shared), `mosaic.py` (TPU: reductions on "arbitrary" grid axes with VMEM
accumulators), `triton.py` (GPU: reductions as fori_loops inside each program),
`mosaic_gpu.py` (Hopper and Blackwell GPUs, jax >= 0.11.2: TMA pipelines, and WGMMA or
tcgen05 with tensor-memory accumulators).

`mhffn` is the one public entry point. It dispatches with `jax.lax.platform_dependent`:
Mosaic on TPU; on a CUDA GPU Mosaic GPU for Hopper (measured faster than Triton on an H200)
and Triton otherwise, Blackwell included until its tcgen05 body is measured
(`dispatch.gpu_backend`); the Mosaic kernel in interpret mode elsewhere (CPU). For
the backward it keeps (q, r^T, K, U, V) with the router transposed to [H, E, T], tokens
on the lane axis (see `tiles.py`), never the [T, H, E] form a TPU pads to 128 lanes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.flash_ffn import (check_mhffn_inputs, fold_gain, fold_router_gain,
                                            route_heads)
from neurips26_jax.jaxops.tiling import round_up
from neurips26_jax.pallas_kernels.dispatch import Backend, KernelConfig, dispatch
from neurips26_jax.pallas_kernels.flash_ffn import mosaic, mosaic_gpu, triton
from neurips26_jax.pallas_kernels.flash_ffn.blocks import TUNED, BlockSizes
from neurips26_jax.pallas_kernels.flash_ffn.tiles import MAX_D_H, TilePlan, mosaic_gpu_generations

__all__ = ["BlockSizes", "TUNED", "mhffn", "mhffn_routed"]

_KERNELS = {"mosaic": mosaic, "triton": triton, "mosaic_gpu": mosaic_gpu}


def _forward(backend: Backend, interpret, blocks: BlockSizes, q, r_t, k, u, v):
  plan = TilePlan.make(backend, blocks, q, k)
  o = _KERNELS[backend].forward(plan, plan.tokens_in(q), plan.router_in(r_t, plan.orient),
                                *(plan.table_in(t) for t in (k, u, v)), interpret)
  return plan.tokens_out(o, q)


def _backward(backend: Backend, interpret, blocks: BlockSizes, q, r_t, k, u, v, ds):
  plan = TilePlan.make(backend, blocks, q, k)
  dq, dr, dk, du, dv = _KERNELS[backend].backward(
      plan, plan.tokens_in(q), plan.router_in(r_t, plan.orient),
      plan.router_in(r_t, plan.orient_dkuv), *(plan.table_in(t) for t in (k, u, v)),
      plan.tokens_in(ds.astype(q.dtype)), interpret)
  dr = plan.router_out(dr, q.shape[:3] + (k.shape[1],))   # same shape from every branch
  return (plan.tokens_out(dq, q), dr, *(plan.table_out(t, k) for t in (dk, du, dv)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mhffn(q, r, k, u, v, cfg: KernelConfig):
  return dispatch(_forward, cfg, q, TilePlan.router_t(r), k, u, v)


def _mhffn_fwd(q, r, k, u, v, cfg):
  r_t = TilePlan.router_t(r)
  # r's dtype rides along in an empty array (residuals must be arrays).
  return dispatch(_forward, cfg, q, r_t, k, u, v), (q, r_t, k, u, v, jnp.zeros((0,), r.dtype))


def _mhffn_bwd(cfg, residuals, ds):
  q, r_t, k, u, v, r_like = residuals
  dq, dr, dk, du, dv = dispatch(_backward, cfg, q, r_t, k, u, v, ds)
  return dq, dr.astype(r_like.dtype), dk, du, dv


_mhffn.defvjp(_mhffn_fwd, _mhffn_bwd)


def _routes_in_kernel(backend: Backend, plan: TilePlan) -> bool:
  """Whether the head norm and router run inside the kernels: Mosaic, with a head's tables in
  one expert group (the router's sum spans every expert)."""
  return backend == "mosaic" and plan.groups == 1


def _lanes(w_r, dtype):
  """W_r [H, d_h, E] -> q's dtype, E zero-padded to whole 128-lane vregs (the kernels mask
  the padding out of the router's sum)."""
  return jnp.pad(w_r.astype(dtype), ((0, 0), (0, 0), (0, round_up(w_r.shape[2], 128) -
                                                       w_r.shape[2])))


def _flat(q):
  return q.reshape(*q.shape[:2], -1)


def _gain_in(plan: TilePlan, gain):
  """gain [H, d_h] -> float32 [H, 1, d_h] padded to the kernels' d_h."""
  return jnp.pad(gain.astype(jnp.float32), ((0, 0), (0, plan.d_h - gain.shape[1])))[:, None]


def _routed_forward(backend: Backend, interpret, blocks: BlockSizes, q, w_r, k, u, v, gain, *,
                    normalize):
  plan = TilePlan.make(backend, blocks, q, k)
  if not _routes_in_kernel(backend, plan):
    q_hat, r = route_heads(_flat(q), w_r, normalize=normalize)
    return _forward(backend, interpret, blocks, q_hat, TilePlan.router_t(r),
                    *fold_gain(k, u, v, gain, q.dtype))
  router = mosaic.Router(normalize, w_r.shape[2])
  o = mosaic.forward(plan, plan.tokens_in(q), _lanes(w_r, q.dtype),
                     *(plan.table_in(t) for t in (k, u, v)), interpret, router=router,
                     gain=_gain_in(plan, gain))
  return plan.tokens_out(o, q)


def _routed_backward(backend: Backend, interpret, blocks: BlockSizes, q, w_r, k, u, v, gain,
                     ds, *, normalize):
  plan = TilePlan.make(backend, blocks, q, k)
  if not _routes_in_kernel(backend, plan):
    (q_hat, r), route_vjp = jax.vjp(functools.partial(route_heads, normalize=normalize),
                                    _flat(q), w_r)
    tables, fold_vjp = jax.vjp(lambda *a: fold_gain(*a, q.dtype), k, u, v, gain)
    dq_hat, dr, *dtables = _backward(backend, interpret, blocks, q_hat, TilePlan.router_t(r),
                                     *tables, ds)
    dq, dw_r = route_vjp((dq_hat, dr))
    return (dq.reshape(q.shape), dw_r, *fold_vjp(tuple(dtables)))
  router, w_lanes = mosaic.Router(normalize, w_r.shape[2]), _lanes(w_r, q.dtype)
  dq, dw_r, dk, du, dv, dgain = mosaic.backward(
      plan, plan.tokens_in(q), w_lanes, w_lanes, *(plan.table_in(t) for t in (k, u, v)),
      plan.tokens_in(ds.astype(q.dtype)), interpret, router=router, gain=_gain_in(plan, gain))
  return (plan.tokens_out(dq, q), dw_r[:, :, :w_r.shape[2]],
          *(plan.table_out(t, k) for t in (dk, du, dv)), dgain[:, 0, :gain.shape[1]])


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _mhffn_routed(q, w_r, k, u, v, gain, cfg: KernelConfig, normalize: bool):
  return dispatch(functools.partial(_routed_forward, normalize=normalize), cfg, q, w_r, k, u, v,
                  gain)


def _mhffn_routed_fwd(q, w_r, k, u, v, gain, cfg, normalize):
  # Only the inputs are kept: q_hat and the router weights are recomputed in the backward.
  return _mhffn_routed(q, w_r, k, u, v, gain, cfg, normalize), (q, w_r, k, u, v, gain)


def _mhffn_routed_bwd(cfg, normalize, residuals, ds):
  grads = dispatch(functools.partial(_routed_backward, normalize=normalize), cfg, *residuals,
                   ds)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, residuals))


_mhffn_routed.defvjp(_mhffn_routed_fwd, _mhffn_routed_bwd)


def mhffn_routed(q: jax.Array, w_r: jax.Array, k: jax.Array, u: jax.Array, v: jax.Array, *,
                 gain: jax.Array | None = None, normalize: bool = True, interpret: Any = None,
                 backend: Backend | None = None, **block_sizes: int) -> jax.Array:
  """FlashFFN's head norm (with its gain), router and mixture from W_in's output,
  differentiable in every array.

  o = mhffn(q_hat g, r, k, u, v) with (q_hat, r) = `jaxops.flash_ffn.route_heads`(q, g W_r):
  on TPU (and interpreted on CPU) the norm and router run inside the Mosaic kernels, so
  neither q_hat nor r is ever written to HBM, and the backward recomputes them from q; the
  kernels also read the tables as stored and fold g into them in VMEM, once per head, so no
  cast or scaled copy of a table reaches HBM either. Elsewhere (GPU, or tables too large for
  one expert group) the norm, router and fold run in XLA around `mhffn`'s kernels and are
  recomputed in the backward too. Either way the backward keeps only the inputs.

  Args:
    q: [B, L, H, d_h] W_in's output (not normalized), float32 or bfloat16.
    w_r: [H, d_h, E] the router (any float dtype: its matmul runs in q's dtype with float32
      accumulation).
    k, u, v: [H, E, d_e, d_h] tables in any float dtype (normally the float32 parameters):
      the matmuls take them in q's dtype, and their gradients come back in their own.
    gain: [H, d_h] the norm's gain g, or None (no gain).
    normalize: the per-head RMSNorm of q (eps 1e-6), as the layer's `head_norm`.
    interpret, backend, **block_sizes: as `mhffn`.

  Returns:
    o: [B, L, H, d_h] in q.dtype.
  """
  checks.floating("mhffn_routed", "q", q)
  checks.shape("mhffn_routed", "q", q, (None, None, None, None), "[B, L, H, d_h]")
  heads, d_h = q.shape[2:]
  checks.shape("mhffn_routed", "w_r", w_r, (heads, d_h, None), f"[H={heads}, d_h={d_h}, E]")
  checks.shape("mhffn_routed", "k", k, (heads, w_r.shape[2], None, d_h),
               f"[H={heads}, E={w_r.shape[2]}, d_e, d_h={d_h}]")
  for name, t in (("u", u), ("v", v)):
    checks.shape("mhffn_routed", name, t, k.shape, f"the shape of k {tuple(k.shape)}")
  if gain is None:
    gain = jnp.ones((heads, d_h), jnp.float32)
  else:
    checks.shape("mhffn_routed", "gain", gain, (heads, d_h), f"[H={heads}, d_h={d_h}]")
    w_r = fold_router_gain(w_r, gain)
  cfg = _config("mhffn_routed", q, backend, interpret, block_sizes)
  return _mhffn_routed(q, w_r, k, u, v, gain, cfg, normalize)


def mhffn(q: jax.Array, r: jax.Array, k: jax.Array, u: jax.Array, v: jax.Array, *,
          interpret: Any = None, backend: Backend | None = None,
          **block_sizes: int) -> jax.Array:
  """Fused multi-head FFN, differentiable in all five inputs.

  Args:
    q: [B, L, H, d_h] per-head inputs (float32 or bfloat16).
    r: [B, L, H, E] normalized router weights.
    k, u, v: [H, E, d_e, d_h] gate / up / down tables (q's dtype).
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Mosaic GPU on
      Hopper for 16-bit inputs and heads it serves, `tiles.MAX_D_H`; Triton otherwise, and
      on Blackwell until its body is measured on a chip: `dispatch.MEASURED_FASTER`); True
      (or the backend's interpreter params, `pltpu.InterpretParams` /
      `plgpu.InterpretGPUParams`) interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic", "triton" or "mosaic_gpu", the last on jax >=
      0.11.2); with `interpret` this runs the other platform's kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (block_q, block_inter, block_q_dkv,
      num_warps, num_warps_dkv, num_stages, compute_wgs); the defaults come from `TUNED` for
      the chip and dtype.

  Returns:
    o: [B, L, H, d_h] in q.dtype; matmuls in the input dtype with float32 accumulation.
  """
  check_mhffn_inputs(q, r, k, u, v)
  return _mhffn(q, r, k, u, v, _config("mhffn", q, backend, interpret, block_sizes))


def _config(op: str, q, backend, interpret, block_sizes) -> KernelConfig:
  # backend=None takes Triton on a generation whose kernels are narrower than the heads; a
  # forced "mosaic_gpu" keeps every generation, so TilePlan names the width limit.
  generations = (tuple(MAX_D_H) if backend == "mosaic_gpu"
                 else mosaic_gpu_generations(q.shape[-1], q.dtype))
  return KernelConfig.make(op, BlockSizes, backend=backend, interpret=interpret,
                           block_sizes=block_sizes, backends=("mosaic", "triton", "mosaic_gpu"),
                           generations=generations)
