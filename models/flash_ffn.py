"""FlashFFN and SwiGLU as Flax NNX layers with one call signature: y = layer(x), x [..., d]."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import flash_ffn as ffn_ops
from neurips26_jax.models import impl as impl_table
from neurips26_jax.models.impl import Impl, resolve_impl
from neurips26_jax.models.partitioning import is_split, param, scale


# The paper's head width (FlashMHF configs: d_h = 128 at every size). On TPU v6e, whose MXUs
# are 256 deep, heads of 256 (num_heads = d / 256) run the same FLOPs 1.9x faster in libtpu's
# estimate (benchmarks/README.md, TPU speed); a model choice, so not the default.
DEFAULT_HEAD_DIM = 128
# The paper's sub-network width; a layer whose per-head budget E d_e is smaller splits it in two.
PAPER_D_EXPERT = 256
INITS = ("scaled", "paper")


def default_d_expert(d_head: int) -> int:
  """The paper's alternative sub-network width: round_up(8/3 * d_h, 128)."""
  return 128 * math.ceil(8 * d_head / 3 / 128)


def swiglu_width(d_model: int) -> int:
  """SwiGLU's default hidden width: 8/3 d rounded up to a multiple of 8 (LLaMA's rule; it keeps
  a SwiGLU at the parameter count of a 4 d GELU MLP)."""
  return 8 * math.ceil(8 * d_model / 3 / 8)


def default_head_dim(d_model: int) -> int:
  """The largest multiple of 8 that divides d_model and is at most DEFAULT_HEAD_DIM."""
  width = min(DEFAULT_HEAD_DIM, d_model) // 8 * 8
  while width > 8 and d_model % width:
    width -= 8
  return max(width, 8)


def flashffn_param_count(d_model: int, num_experts: int, d_expert: int) -> int:
  """2 d^2 + 3 d d_ff + d E, d_ff = E d_e (head-norm gains, d more, not included)."""
  return 2 * d_model**2 + 3 * d_model * num_experts * d_expert + d_model * num_experts


def flashffn_shape(d_model: int, params: int, *, head_norm: bool = True) -> dict[str, int]:
  """E and d_e of a FlashFFN with about `params` parameters (the rule behind its defaults).

  The per-head width E d_e takes what W_in, W_out (2 d^2), the router (d E) and the norm gains
  (d) leave: E = max(2, round(E d_e / PAPER_D_EXPERT)) (at least two sub-networks, so the
  router mixes; the paper's d_e = 256 where the budget allows), d_e the multiple of 8 nearest
  the rest. Returns {"num_experts": E, "d_expert": d_e}.
  """
  rest = params - 2 * d_model**2 - (d_model if head_norm else 0)
  if rest < 16 * (3 * d_model + 1):
    raise ValueError(f"FlashFFN: a budget of {params:,} parameters leaves no room for two "
                     f"sub-networks of width 8 beside W_in and W_out (2 d^2 = {2 * d_model**2:,})")
  experts = max(2, round(rest / (3 * d_model + 1) / PAPER_D_EXPERT))
  d_expert = max(8, 8 * round((rest / experts - d_model) / (3 * d_model) / 8))
  return {"num_experts": experts, "d_expert": d_expert}


def heads_and_router(x: jax.Array, w_in: jax.Array, router: jax.Array, *, normalize: bool,
                     dtype: DTypeLike) -> tuple[jax.Array, jax.Array]:
  """Per-head inputs and router weights of FlashFFN: `jaxops.flash_ffn.route_heads` on
  x W_in. x [B, L, d], w_in [d, d], router [H, d_h, E] -> q [B, L, H, d_h] (dtype),
  r [B, L, H, E] (float32)."""
  return ffn_ops.route_heads(x.astype(dtype) @ w_in.astype(dtype), router, normalize=normalize)


def _xavier(gain: float):
  return jax.nn.initializers.variance_scaling(gain**2, "fan_avg", "uniform")


def _normal(variance: float):
  return jax.nn.initializers.normal(math.sqrt(variance))


class FlashFFN(nnx.Module):
  """Multi-head FFN with a dense mixture of E sub-networks per head (DESIGN.md section 2).

  x [B, L, d] -> q = x W_in split into H heads [B, L, H, d_h] -> optional per-head RMSNorm
  -> router r = sigmoid(q W_r) / sum (float32) -> fused mixture (see `jaxops.flash_ffn`)
  -> concat heads -> W_out -> y [B, L, d]. Params: 2 d^2 + 3 d d_ff + d E (+ d norm gains),
  d_ff = E d_e.

  Defaults (each a rule, so `FlashFFN(d)` is a drop-in for `SwiGLU(d)`):
    num_heads: d / `default_head_dim(d)` (head width 128, the paper's, or the largest multiple
      of 8 dividing d below it); it does not follow the attention's head count.
    num_experts, d_expert: `flashffn_shape(d, 3 d d_ff)`: the parameter count of a SwiGLU of
      width d_ff (default `swiglu_width(d)` = 8/3 d), E >= 2.
    init="scaled": every matmul keeps unit-variance inputs at unit variance, as SwiGLU's
      LeCun-normal init does: W_in, W_out ~ N(0, 1/d); K, U ~ N(0, 1/d_h) (fan-in d_h);
      V ~ N(0, E/d_e): fan-in d_e, times E because at init the router weights are ~1/E and
      average E independent sub-network outputs, which divides their variance by E. Output
      and input-gradient RMS at init then match a SwiGLU's of the same d and parameter count
      within 2x for d_h 32-128 and E 1-11 (tested; the repository's benchmarks/init_scale.py).
      init="paper" is FlashMHF's: W_in, W_out Xavier-uniform gain 0.707, K, U, V ~ N(0, 0.02),
      chosen at d_h = 128 and blind to the widths (its output starts 200-800x smaller than a
      SwiGLU's at d = 128). The router is truncated-normal(0.02) and the norm gain 1 in both.
    The norm gain is a scale (never weight-decayed, see `train.optim`).

  Args:
    d_model: d. num_heads, num_experts, d_expert: H, E, d_e (None: the defaults above);
      d_h = d / H and d_e must be multiples of 8.
    d_ff: the SwiGLU width whose parameter count the default E, d_e match.
    head_norm: the per-head RMSNorm of q (the paper's default: on).
    init: "scaled" (default) or "paper".
    impl: "auto" (default), "pallas" (fused kernel), "xla" (chunked XLA path) or
      "reference"; see `models.impl`.
    chunk: tokens per chunk of the "xla" path (None: `models.impl.CHUNKS`, 512).
    interpret: passed to the Pallas kernel (None: interpret on CPU only).
    backend: force a kernel body, "mosaic", "triton" or "mosaic_gpu" (None: the dispatch's
      choice per chip and dtype; README's table). `models.impl.kernel_body(layer, x)` says
      which body a call runs.
    dtype: compute dtype (params are cast to it); None uses the input's dtype.
  """

  def __init__(self, d_model: int, num_heads: int | None = None, num_experts: int | None = None,
               d_expert: int | None = None, *, d_ff: int | None = None, head_norm: bool = True,
               init: str = "scaled", impl: Impl = "auto", chunk: int | None = None,
               interpret: Any = None, backend: str | None = None, dtype: DTypeLike | None = None,
               param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs) -> None:
    checks.ints("FlashFFN", dict(d_model=d_model,
                                 **checks.given(num_heads=num_heads, num_experts=num_experts,
                                                d_expert=d_expert, d_ff=d_ff, chunk=chunk)))
    checks.one_of("FlashFFN", "init", init, INITS)
    if num_heads is None:
      if d_model % 8:
        raise ValueError(
            f"FlashFFN: `d_model` ({d_model}) has no default head count: the rule "
            f"(`default_head_dim`) takes the largest head width <= {DEFAULT_HEAD_DIM} that is "
            f"a multiple of 8 and divides d_model, and none does; use a d_model that is a "
            f"multiple of 8 (e.g. {d_model // 8 * 8 or 8} or {d_model // 8 * 8 + 8}), or pass "
            f"`num_heads` with d_model / num_heads a multiple of 8")
      num_heads = d_model // default_head_dim(d_model)
    if num_experts is None or d_expert is None:
      swiglu_params = 3 * d_model * (swiglu_width(d_model) if d_ff is None else d_ff)
      shape = flashffn_shape(d_model, swiglu_params, head_norm=head_norm)
      num_experts = shape["num_experts"] if num_experts is None else num_experts
      d_expert = shape["d_expert"] if d_expert is None else d_expert
    checks.multiple("FlashFFN", "`d_model`", d_model, num_heads, "`num_heads`")
    d_h = d_model // num_heads
    checks.multiple("FlashFFN", "the head width d_model / num_heads", d_h, 8)
    checks.multiple("FlashFFN", "`d_expert`", d_expert, 8)
    self.num_heads, self.impl, self.chunk, self.dtype = (
        num_heads, resolve_impl("FlashFFN", impl, backend=backend), chunk, dtype)
    self.interpret, self.backend = interpret, backend
    if init == "scaled":
      w_init = jax.nn.initializers.lecun_normal()
      gate_up, down = _normal(1 / d_h), _normal(num_experts / d_expert)
    else:
      w_init = _xavier(0.707)
      gate_up = down = jax.nn.initializers.normal(0.02)
    # logical axes (models.partitioning): the H d_h columns of W_in / rows of W_out and the
    # leading H of the per-head tables are heads (split over "tensor"), the rest over "fsdp"
    self.w_in = param(w_init(rngs.params(), (d_model, d_model), param_dtype), "embed", "heads",
                      cast=True)
    self.norm_gain = (scale(jnp.ones((num_heads, d_h), param_dtype), "heads", "head_dim")
                      if head_norm else None)
    self.router = param(jax.nn.initializers.truncated_normal(0.02)(
        rngs.params(), (num_heads, d_h, num_experts), param_dtype), "heads", "head_dim", None)
    shape = (num_heads, num_experts, d_expert, d_h)
    table_axes = ("heads", None, "expert_mlp", "head_dim")
    self.k = param(gate_up(rngs.params(), shape, param_dtype), *table_axes, cast=True)
    self.u = param(gate_up(rngs.params(), shape, param_dtype), *table_axes, cast=True)
    self.v = param(down(rngs.params(), shape, param_dtype), *table_axes, cast=True)
    self.w_out = param(w_init(rngs.params(), (d_model, d_model), param_dtype), "heads", "embed",
                       cast=True)

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d] -> [..., d] in the compute dtype, as SwiGLU: every token on its own.

    [B, L, d] goes to the kernel as it is (its batch axis may be sharded); other ranks are
    folded to that form, [N, d] as one sequence of N tokens.
    """
    checks.features("FlashFFN", "x", x, self.w_in.shape[0])
    dtype = self.dtype or x.dtype
    cfg = _Mixture(self.norm_gain is not None, self.impl, self.chunk, self.interpret,
                   self.backend)
    tokens = x.reshape((-1,) + x.shape[-2:] if x.ndim >= 3 else (1, -1, x.shape[-1]))
    # The op folds the gain in and casts the tables (on TPU inside the kernels, in VMEM), so
    # tables that reach it as stored leave no copy for the backward. Tables split over devices
    # (fsdp) are gathered into a whole copy anyway: cast first, it moves half the bytes.
    tables = [t[...].astype(dtype) if is_split(t) else t[...] for t in (self.k, self.u, self.v)]
    gain = None if self.norm_gain is None else self.norm_gain[...]
    y = _ordered_layer(tokens.astype(dtype), self.w_in[...].astype(dtype), self.router[...],
                       *tables, gain, self.w_out[...].astype(dtype), cfg)
    return y.reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class _Mixture:
  """How `_ordered_layer` runs the mixture: head norm on or off, and the op's implementation
  (`models.impl`) with its chunk, interpret and backend options."""

  normalize: bool
  impl: str
  chunk: int | None
  interpret: object
  backend: str | None = None

  def __call__(self, q, router, k, u, v, gain):
    """W_in's output q [B, L, d] -> the mixture's output [B, L, d]."""
    # d_h from the router: under shard_map the layer sees its local heads only.
    o = impl_table.call("flash_ffn_routed", self.impl,
                        q.reshape(*q.shape[:-1], -1, router.shape[1]), router, k, u, v, gain,
                        chunk=self.chunk, interpret=self.interpret, backend=self.backend,
                        normalize=self.normalize)
    return o.reshape(q.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _ordered_layer(x, w_in, router, k, u, v, gain, w_out, mixture: _Mixture):
  """y = mixture(x W_in) W_out with a backward that frees the mixture's output early.

  Kept for the backward: x, q = x W_in and the mixture's output o (and the weights); the op
  keeps only its inputs and recomputes its head norm and router. The backward computes dW_out
  and o's cotangent first, so o is dead before the op's backward runs, which then holds two
  [L, d] buffers beside the tables: q, and o's cotangent (the Mosaic kernel overwrites it with
  dq). Plain autodiff leaves that order to XLA, which at 32k float32 tokens kept o alive
  through the op's backward (the repository's benchmarks/README.md, FlashFFN memory).
  """
  return _layer_fwd(x, w_in, router, k, u, v, gain, w_out, mixture)[0]


def _layer_fwd(x, w_in, router, k, u, v, gain, w_out, mixture):
  q = x @ w_in
  o = mixture(q, router, k, u, v, gain)
  return o @ w_out, (x, w_in, router, k, u, v, gain, w_out, q, o)


def _layer_bwd(mixture, residuals, dy):
  x, w_in, router, k, u, v, gain, w_out, q, o = residuals
  do, dw_out = jax.vjp(jnp.matmul, o, w_out)[1](dy)
  # The op's backward waits for dW_out (the barrier), so o is freed before it starts.
  q, do, dw_out = jax.lax.optimization_barrier((q, do, dw_out))
  # The op's forward traced here is unused (XLA removes it): only its backward runs.
  dq, drouter, dk, du, dv, dgain = jax.vjp(mixture, q, router, k, u, v, gain)[1](do)
  dx, dw_in = jax.vjp(jnp.matmul, x, w_in)[1](dq)
  return dx, dw_in, drouter, dk, du, dv, dgain, dw_out


_ordered_layer.defvjp(_layer_fwd, _layer_bwd)


class SwiGLU(nnx.Module):
  """The baseline FFN: (silu(x W_gate) * (x W_up)) W_down, 3 d d_ff params.

  x [..., d] -> [..., d]; d_ff: hidden width (None: `swiglu_width(d)` = 8/3 d rounded up to a
  multiple of 8); LeCun-normal init; dtype: compute dtype (None: the input's).
  """

  def __init__(self, d_model: int, d_ff: int | None = None, *, dtype: DTypeLike | None = None,
               param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs) -> None:
    d_ff = swiglu_width(d_model) if d_ff is None else d_ff
    checks.ints("SwiGLU", dict(d_model=d_model, d_ff=d_ff))
    init = jax.nn.initializers.lecun_normal()
    self.dtype = dtype
    self.w_gate = param(init(rngs.params(), (d_model, d_ff), param_dtype), "embed", "mlp")
    self.w_up = param(init(rngs.params(), (d_model, d_ff), param_dtype), "embed", "mlp")
    self.w_down = param(init(rngs.params(), (d_ff, d_model), param_dtype), "mlp", "embed")

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [..., d] -> [..., d]."""
    checks.features("SwiGLU", "x", x, self.w_gate.shape[0])
    dtype = self.dtype or x.dtype
    w = [p[...].astype(dtype) for p in (self.w_gate, self.w_up, self.w_down)]
    return ffn_ops.swiglu(x.astype(dtype), *w)
