"""Multi-head FFN with a dense mixture of sub-networks per head (FlashFFN).

Shapes (B batch, L tokens, H heads, d_h head width, E sub-networks per head, d_e
sub-network width, d_ff = E * d_e):

  q     [B, L, H, d_h]   per-head inputs (after W_in and the optional head norm)
  r     [B, L, H, E]     router weights, already normalized
  k,u,v [H, E, d_e, d_h] gate / up / down tables

For each head h and sub-network e::

  A_{h,e} = silu(q_h K_{h,e}^T) * (q_h U_{h,e}^T)          [L, d_e]
  o_h     = sum_e r_{h,e} * (A_{h,e} V_{h,e})              [L, d_h]

`mhffn_reference` writes this out literally; `mhffn` computes the same thing in
token chunks with recomputation in the backward, so the [L, H, d_ff] intermediate
only ever exists for one chunk. The Pallas kernel lives in
`pallas_kernels.flash_ffn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.rms_norm import rms_normalize_groups
from neurips26_jax.jaxops.tiling import seq_chunks, seq_unchunk

_F32 = jnp.float32


def check_mhffn_inputs(q: jax.Array, r: jax.Array, k: jax.Array, u: jax.Array,
                       v: jax.Array) -> None:
  """Raises (see `jaxops.checks`) naming the argument when shapes, dtypes or values do not fit.

  r must hold normalized router weights (>= 0, summing to 1 over E): checked when concrete,
  a `checkify.debug_check` under jit.
  """
  for name, x in (("q", q), ("r", r), ("k", k), ("u", u), ("v", v)):
    if x.ndim != 4:
      raise ValueError(
          f"mhffn: `{name}` must have rank 4, got shape {tuple(x.shape)}")
    checks.floating("mhffn", name, x)
  checks.nonempty("mhffn", "q", q, "[B, L, H, d_h]")
  checks.nonempty("mhffn", "k", k, "[H, E, d_e, d_h]")
  batch, length, heads, d_h = q.shape
  h_k, experts, d_e, d_hk = k.shape
  if h_k != heads or d_hk != d_h:
    raise ValueError(
        f"mhffn: `k` has shape {tuple(k.shape)}; expected [H={heads}, E, d_e, d_h={d_h}]"
        f" to match q {tuple(q.shape)}")
  for name, x in (("u", u), ("v", v)):
    if x.shape != k.shape:
      raise ValueError(
          f"mhffn: `{name}` has shape {tuple(x.shape)}; expected the shape of k {tuple(k.shape)}")
  if r.shape != (batch, length, heads, experts):
    raise ValueError(
        f"mhffn: `r` has shape {tuple(r.shape)}; expected [B, L, H, E] ="
        f" {(batch, length, heads, experts)} from q {tuple(q.shape)} and k {tuple(k.shape)}")
  if d_h % 8 or d_e % 8:
    raise ValueError(
        f"mhffn: d_h ({d_h}, from `q`) and d_e ({d_e}, from `k`) must be multiples of 8")
  # Rounding r to its dtype moves each weight by <= eps/2 of itself, the sum by <= eps/2.
  tol = max(1e-4, 4 * float(jnp.finfo(r.dtype).eps))
  checks.values("mhffn", "r", r, lambda w: (w >= 0) & (abs(w.sum(-1, keepdims=True) - 1) <= tol),
                "hold normalized router weights (>= 0, summing to 1 over E)")


def mhffn_reference(q: jax.Array, r: jax.Array, k: jax.Array, u: jax.Array,
                    v: jax.Array) -> jax.Array:
  """Plain float32 einsum form of the multi-head FFN. Returns o [B, L, H, d_h] in q.dtype."""
  check_mhffn_inputs(q, r, k, u, v)
  q32, r32, k32, u32, v32 = (x.astype(_F32) for x in (q, r, k, u, v))
  m = jnp.einsum("blhd,hefd->blhef", q32, k32)
  n = jnp.einsum("blhd,hefd->blhef", q32, u32)
  a = jax.nn.silu(m) * n
  s = jnp.einsum("blhef,hefd->blhed", a, v32)
  return jnp.einsum("blhed,blhe->blhd", s, r32).astype(q.dtype)


def _mhffn_dense(q, r, k, u, v):
  """One token chunk: matmuls in the input dtype with float32 accumulation.

  Head-major inside, with the E sub-networks of a head side by side (n = E * d_e), so
  every matmul is a plain batched [L, d_h] x [d_h, n] or [L, n] x [n, d_h] product and
  the [L, H, d_ff] intermediate is never transposed.
  """
  heads, experts, d_e, d_h = k.shape
  lead = q.shape[:-2]
  qh = jnp.moveaxis(q.reshape(-1, heads, d_h), 1, 0)                  # [H, T, d_h]
  rh = jnp.moveaxis(r.reshape(-1, heads, experts), 1, 0).astype(_F32)  # [H, T, E]
  flat = lambda t: t.reshape(heads, experts * d_e, d_h)
  m = jnp.einsum("htd,hnd->htn", qh, flat(k), preferred_element_type=_F32)
  n = jnp.einsum("htd,hnd->htn", qh, flat(u), preferred_element_type=_F32)
  a = (jax.nn.silu(m) * n).reshape(*m.shape[:2], experts, d_e) * rh[..., None]
  o = jnp.einsum("htn,hnd->htd", a.reshape(m.shape).astype(v.dtype), flat(v),
                 preferred_element_type=_F32)
  return jnp.moveaxis(o, 0, 1).reshape(*lead, heads, d_h)


# The head norm's epsilon (DESIGN.md section 2, step 2).
NORM_EPS = 1e-6


def route_heads(q: jax.Array, router: jax.Array, *,
                normalize: bool = True) -> tuple[jax.Array, jax.Array]:
  """FlashFFN's head norm and router (DESIGN.md section 2, steps 2-3) on W_in's output.

  q_h <- q_h / sqrt(mean(q_h^2) + 1e-6) if `normalize`;
  r_h = sigmoid(q_h W_r^h) / max(sum_e sigmoid(q_h W_r^h)_e, 1e-20), float32.
  q [..., H d_h] (heads side by side, the compute dtype), router [H, d_h, E] ->
  q_hat [..., H, d_h] in q.dtype, r [..., H, E] float32. A norm gain is the caller's to fold
  into `router` and the tables (`fold_gain`).

  Layout-minded for TPU: q stays flat (the norm's statistics are small matmuls,
  `rms_normalize_groups`) and all heads' logits are one matmul with the block-diagonal
  [H d_h, H E] router (a batched-over-heads einsum makes XLA transpose q and its gradient to
  head-major, two extra [L, d] buffers).
  """
  heads, d_h, experts = router.shape
  lead = q.shape[:-1]
  if normalize:
    q = rms_normalize_groups(q, heads, NORM_EPS)
  block_diag = jnp.einsum("hde,hg->hdge", router.astype(_F32),
                          jnp.eye(heads, dtype=_F32)).reshape(heads * d_h, heads * experts)
  # The logits accumulate in float32 from q in the compute dtype: a float32 copy of q would
  # be kept for the router's gradient (an extra [L, d] float32 buffer), and q carries no more
  # precision than its dtype.
  z = jnp.dot(q, block_diag.astype(q.dtype), preferred_element_type=_F32)
  sig = jax.nn.sigmoid(z.reshape(*lead, heads, experts))
  r = sig / jnp.maximum(jnp.sum(sig, axis=-1, keepdims=True), 1e-20)
  return q.reshape(*lead, heads, d_h), r


def mhffn_routed_reference(q: jax.Array, router: jax.Array, k: jax.Array, u: jax.Array,
                           v: jax.Array, *, gain: jax.Array | None = None,
                           normalize: bool = True) -> jax.Array:
  """Head norm (times its gain), router and mixture written out in float32 einsums: q [B, L,
  H, d_h] (W_in's output), router [H, d_h, E], gain [H, d_h] or None -> o [B, L, H, d_h] in
  q.dtype."""
  q32 = q.astype(_F32)
  if normalize:
    q32 = q32 / jnp.sqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + NORM_EPS)
  if gain is not None:
    q32 = q32 * gain.astype(_F32)
  q_hat = q32.astype(q.dtype)
  sig = jax.nn.sigmoid(jnp.einsum("blhd,hde->blhe", q_hat.astype(_F32), router.astype(_F32)))
  r = sig / jnp.maximum(jnp.sum(sig, axis=-1, keepdims=True), 1e-20)
  return mhffn_reference(q_hat, r, *(t.astype(q.dtype) for t in (k, u, v)))


def fold_gain(k: jax.Array, u: jax.Array, v: jax.Array, gain: jax.Array | None,
              dtype: DTypeLike) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tables (K g, U g, V) in the compute `dtype` for a layer whose heads are q_hat * g.

  (q_hat g) K^T = q_hat (K g)^T: the norm gain g [H, d_h] scales K's and U's d_h columns
  (V's product is d_e-wide, untouched); the router's rows take g the same way
  (`fold_router_gain`). gain=None: the tables only cast.
  """
  if gain is None:
    return tuple(t.astype(dtype) for t in (k, u, v))
  fold = lambda t: (t.astype(_F32) * gain.astype(_F32)[:, None, None, :]).astype(dtype)
  return fold(k), fold(u), v.astype(dtype)


def fold_router_gain(router: jax.Array, gain: jax.Array | None) -> jax.Array:
  """The router [H, d_h, E] for a layer whose heads are q_hat * g: (q_hat g) W_r = q_hat (g
  W_r), its d_h rows scaled by the norm gain g [H, d_h]; gain=None: the router."""
  return router if gain is None else router * gain[:, :, None].astype(router.dtype)


def mhffn_routed(q: jax.Array, router: jax.Array, k: jax.Array, u: jax.Array, v: jax.Array, *,
                 gain: jax.Array | None = None, normalize: bool = True,
                 chunk: int = 512) -> jax.Array:
  """Fast XLA path of the layer's op (`mhffn_routed_reference`'s math): `route_heads` then
  `mhffn`, with the norm gain g [H, d_h] folded into the router's rows and the tables
  (`fold_gain`). q [B, L, H, d_h] -> o [B, L, H, d_h] in q.dtype."""
  q_hat, r = route_heads(q.reshape(*q.shape[:2], -1), fold_router_gain(router, gain),
                         normalize=normalize)
  return mhffn(q_hat, r, *fold_gain(k, u, v, gain, q.dtype), chunk=chunk)


def mhffn(q: jax.Array, r: jax.Array, k: jax.Array, u: jax.Array, v: jax.Array, *,
          chunk: int = 512) -> jax.Array:
  """Fast XLA path: `mhffn_reference` computed `chunk` tokens at a time.

  Each chunk is wrapped in `jax.checkpoint`, so the backward pass recomputes the
  [chunk, H, d_ff] intermediate instead of storing it for all L tokens: activation
  memory is O(chunk * H * d_ff) rather than O(L * H * d_ff). Any L (padded inside).
  """
  check_mhffn_inputs(q, r, k, u, v)
  checks.ints("mhffn", {"chunk": chunk})
  chunk = min(chunk, q.shape[1])
  body = jax.checkpoint(lambda qr: _mhffn_dense(qr[0], qr[1], k, u, v))
  o = jax.lax.map(body, (seq_chunks(q, chunk), seq_chunks(r, chunk)))
  return seq_unchunk(o, q.shape[1]).astype(q.dtype)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """The SwiGLU baseline: (silu(x W_gate) * (x W_up)) W_down.

  x [..., d], w_gate and w_up [d, d_ff], w_down [d_ff, d] -> [..., d].
  """
  checks.shape("swiglu", "w_gate", w_gate, (None, None), "[d, d_ff]")
  d, d_ff = w_gate.shape
  checks.shape("swiglu", "w_up", w_up, (d, d_ff), f"[d={d}, d_ff={d_ff}] like w_gate")
  checks.shape("swiglu", "w_down", w_down, (d_ff, d), f"[d_ff={d_ff}, d={d}]")
  if x.ndim < 1 or x.shape[-1] != d:
    raise ValueError(f"swiglu: `x` must be [..., d={d}], got shape {tuple(x.shape)}")
  h = jax.nn.silu(x @ w_gate) * (x @ w_up)
  return h @ w_down
