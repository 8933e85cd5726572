"""FlashFFN and SwiGLU as Flax NNX layers with one call signature: y = layer(x), x [B, L, d]."""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from flax import nnx

from jaxops import checks
from jaxops import flash_ffn as ffn_ops
from jaxops.rms_norm import rms_normalize_groups
from models.impl import Impl, resolve_impl
from models.partitioning import param
from pallas_kernels import flash_ffn as ffn_kernel


def default_d_expert(d_head: int) -> int:
  """The paper's alternative sub-network width: round_up(8/3 * d_h, 128)."""
  return 128 * math.ceil(8 * d_head / 3 / 128)


def flashffn_param_count(d_model: int, num_experts: int, d_expert: int) -> int:
  """2 d^2 + 3 d d_ff + d E, d_ff = E d_e (head-norm gains, d more, not included)."""
  return 2 * d_model**2 + 3 * d_model * num_experts * d_expert + d_model * num_experts


def flashffn_matching_swiglu(d_model: int, d_ff: int, *, d_expert: int = 256) -> dict:
  """FlashFFN shape whose parameter count is closest to a SwiGLU of width d_ff (3 d d_ff).

  Returns {"num_experts": E, "d_expert": d_e}.
  """
  target = 3 * d_model * d_ff
  experts = max(1, round((target - 2 * d_model**2) / (3 * d_model * d_expert + d_model)))
  return {"num_experts": experts, "d_expert": d_expert}


def heads_and_router(x, w_in, router, *, normalize: bool, dtype):
  """Per-head inputs and router weights of FlashFFN.

  q = x W_in split into heads, q_h <- q_h / rms(q_h) if `normalize`,
  r_h = sigmoid(q_h W_r^h) / max(sum_e sigmoid(q_h W_r^h)_e, 1e-20) in float32.
  x [B, L, d], w_in [d, d], router [H, d_h, E] -> q [B, L, H, d_h] (dtype),
  r [B, L, H, E] (float32). The norm's gain is folded into `router` and the tables by
  the caller (see `FlashFFN.__call__`).
  """
  heads, d_h, experts = router.shape
  lead = x.shape[:-1]
  q = x.astype(dtype) @ w_in.astype(dtype)                          # [B, L, H d_h], flat
  if normalize:
    q = rms_normalize_groups(q, heads)
  # All heads' z_h = q_h W_r^h as one plain matmul with the block-diagonal [H d_h, H E]
  # router: a batched-over-heads einsum makes XLA transpose q and its gradient to
  # head-major, two extra [L, d] buffers.
  block_diag = jnp.einsum("hde,hg->hdge", router.astype(jnp.float32),
                          jnp.eye(heads, dtype=jnp.float32)).reshape(heads * d_h, heads * experts)
  # The logits accumulate in float32 from q in the compute dtype: a float32 copy of q
  # would be kept for the router weights' gradient (an extra [L, d] float32 buffer, 64 MiB
  # at 16k tokens of the 370M layer), and q carries no more precision than its dtype.
  z = jnp.dot(q, block_diag.astype(q.dtype), preferred_element_type=jnp.float32)
  sig = jax.nn.sigmoid(z.reshape(*lead, heads, experts))
  r = sig / jnp.maximum(jnp.sum(sig, axis=-1, keepdims=True), 1e-20)
  return q.reshape(*lead, heads, d_h), r


def _xavier(gain: float):
  return jax.nn.initializers.variance_scaling(gain**2, "fan_avg", "uniform")


class FlashFFN(nnx.Module):
  """Multi-head FFN with a dense mixture of E sub-networks per head (DESIGN.md section 2).

  x [B, L, d] -> q = x W_in split into H heads [B, L, H, d_h] -> optional per-head RMSNorm
  -> router r = sigmoid(q W_r) / sum (float32) -> fused mixture (see `jaxops.flash_ffn`)
  -> concat heads -> W_out -> y [B, L, d]. Params: 2 d^2 + 3 d d_ff + d E (+ d norm gains),
  d_ff = E d_e.

  Args:
    d_model, num_heads, num_experts, d_expert: d, H, E, d_e; d_h = d / H and d_e must be
      multiples of 8.
    impl: "auto" (default), "pallas" (fused kernel), "xla" (chunked XLA path) or
      "reference"; see `models.impl`.
    chunk: tokens per chunk of the "xla" path.
    interpret: passed to the Pallas kernel (None: interpret on CPU only).
    dtype: compute dtype (params are cast to it); None uses the input's dtype.
  """

  def __init__(self, d_model: int, num_heads: int, num_experts: int, d_expert: int, *,
               head_norm: bool = True, impl: Impl = "auto", chunk: int = 512,
               interpret=None, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs):
    checks.ints("FlashFFN", dict(d_model=d_model, num_heads=num_heads, num_experts=num_experts,
                                 d_expert=d_expert, chunk=chunk))
    checks.multiple("FlashFFN", "`d_model`", d_model, num_heads, "`num_heads`")
    d_h = d_model // num_heads
    checks.multiple("FlashFFN", "the head width d_model / num_heads", d_h, 8)
    checks.multiple("FlashFFN", "`d_expert`", d_expert, 8)
    self.num_heads, self.impl, self.chunk, self.dtype = (
        num_heads, resolve_impl("FlashFFN", impl), chunk, dtype)
    self.interpret = interpret
    table = jax.nn.initializers.normal(0.02)
    # logical axes (models.partitioning): the H d_h columns of W_in / rows of W_out and the
    # leading H of the per-head tables are heads (split over "tensor"), the rest over "fsdp"
    self.w_in = param(_xavier(0.707)(rngs.params(), (d_model, d_model), param_dtype),
                      "embed", "heads")
    self.norm_gain = (param(jnp.ones((num_heads, d_h), param_dtype), "heads", "head_dim")
                      if head_norm else None)
    self.router = param(jax.nn.initializers.truncated_normal(0.02)(
        rngs.params(), (num_heads, d_h, num_experts), param_dtype), "heads", "head_dim", None)
    shape = (num_heads, num_experts, d_expert, d_h)
    table_axes = ("heads", None, "expert_mlp", None)
    self.k = param(table(rngs.params(), shape, param_dtype), *table_axes)
    self.u = param(table(rngs.params(), shape, param_dtype), *table_axes)
    self.v = param(table(rngs.params(), shape, param_dtype), *table_axes)
    self.w_out = param(_xavier(0.707)(rngs.params(), (d_model, d_model), param_dtype),
                       "heads", "embed")

  def _folded(self, dtype):
    """(router, k, u, v) with the head-norm gain g folded in.

    (q_hat * g) K^T = q_hat (K * g)^T, so scaling the d_h columns of K, U and the rows
    of W_r by g is the same as scaling q: the kernel then sees the normalized q_hat,
    which the norm's backward keeps anyway (one saved [L, d] buffer instead of two).
    """
    router = self.router[...]
    k, u, v = (t[...].astype(dtype) for t in (self.k, self.u, self.v))
    if self.norm_gain is None:
      return router, k, u, v
    gain = self.norm_gain[...]
    fold = lambda t: (t * gain[:, None, None, :].astype(dtype)).astype(dtype)
    return router * gain[:, :, None], fold(k), fold(u), v

  def __call__(self, x):
    """x [B, L, d] -> [B, L, d] in the compute dtype."""
    checks.sequence("FlashFFN", "x", x, self.w_in.shape[0])
    dtype = self.dtype or x.dtype
    router, k, u, v = self._folded(dtype)
    q, r = heads_and_router(x, self.w_in[...], router, normalize=self.norm_gain is not None,
                            dtype=dtype)
    if self.impl == "pallas":
      o = ffn_kernel.mhffn(q, r, k, u, v, interpret=self.interpret)
    elif self.impl == "xla":
      o = ffn_ops.mhffn(q, r, k, u, v, chunk=self.chunk)
    else:
      o = ffn_ops.mhffn_reference(q, r, k, u, v)
    return o.reshape(x.shape[:-1] + (-1,)) @ self.w_out[...].astype(dtype)


class SwiGLU(nnx.Module):
  """The baseline FFN: (silu(x W_gate) * (x W_up)) W_down, 3 d d_ff params.

  x [..., d] -> [..., d]; dtype: compute dtype (None: the input's).
  """

  def __init__(self, d_model: int, d_ff: int, *, dtype=None, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    checks.ints("SwiGLU", dict(d_model=d_model, d_ff=d_ff))
    init = jax.nn.initializers.lecun_normal()
    self.dtype = dtype
    self.w_gate = param(init(rngs.params(), (d_model, d_ff), param_dtype), "embed", "mlp")
    self.w_up = param(init(rngs.params(), (d_model, d_ff), param_dtype), "embed", "mlp")
    self.w_down = param(init(rngs.params(), (d_ff, d_model), param_dtype), "mlp", "embed")

  def __call__(self, x):
    """x [..., d] -> [..., d]."""
    d_model = self.w_gate.shape[0]
    if x.ndim < 1 or x.shape[-1] != d_model:
      raise ValueError(f"SwiGLU: `x` must be [..., d_model={d_model}], got shape {x.shape}")
    checks.floating("SwiGLU", "x", x)
    dtype = self.dtype or x.dtype
    w = [p[...].astype(dtype) for p in (self.w_gate, self.w_up, self.w_down)]
    return ffn_ops.swiglu(x.astype(dtype), *w)
