"""FRACMixer: a Mamba-2 style selective SSM layer with power-law memory (DESIGN.md section 4)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops.rms_norm import rms_normalize
from neurips26_jax.models import impl as impl_table
from neurips26_jax.models import partitioning
from neurips26_jax.models.impl import Impl, resolve_impl
from neurips26_jax.models.partitioning import param

_F32 = jnp.float32


# Default alpha_h at init: alpha_min + (1 - alpha_min) sigmoid(logit_h) with the heads'
# sigmoids evenly spaced over [ALPHA_INIT_SPAN, 1 - ALPHA_INIT_SPAN], where sigmoid' >= 0.127:
# no head starts on the flat tail of the sigmoid, where its alpha could not move.
ALPHA_INIT_SPAN = 0.15
# The floor of alpha: 0.05 puts the default heads at alpha 0.19-0.86, the design's
# [0.2, 0.9] spread, as closely as a start with every head trainable allows (with the floor at
# 0.2 the lowest head of that spread sat on the floor, d alpha / d logit ~ 8e-4).
ALPHA_MIN = 0.05


# init="mamba_ssm" (the one-mode layer as mamba_ssm's Mamba2 initialises it): A_h ~ U[A_RANGE],
# stored as log A_h; dt_h = exp(U[log DT_RANGE[0], log DT_RANGE[1]]), at least DT_FLOOR, stored
# as its inverse softplus in dt_bias.
MAMBA_SSM_A_RANGE = (1.0, 16.0)
MAMBA_SSM_DT_RANGE = (1e-3, 1e-1)
MAMBA_SSM_DT_FLOOR = 1e-4
INITS = ("default", "mamba_ssm")


def _inverse_softplus(y):
  return y + jnp.log(-jnp.expm1(-y))


def _logit(p):
  return jnp.log(p) - jnp.log1p(-p)


class FRACMixer(nnx.Module):
  """Selective SSM mixer whose per-head memory decays as (1 + u)^(-alpha_h).

  x [B, L, d] -> in_proj -> (z [d_in], x [d_in], B [N], C [N], dt [H]), d_in = H P
                 (stored as in_proj [d, 2, d_in] for z, x; bc_proj [d, 2N]; dt_proj [d, H])
  (x, B, C) -> causal depthwise conv (width `conv_width`) -> silu;  B, C shared by heads
  dt = softplus(dt + dt_bias)                                     float32, init ~ 1
  (rates, weights) = soe_modes(alpha_h) with rates * exp(log_timescale_h)   [H, M]
  y = frac_scan(x, dt, B, C, rates, weights) + D x                (see `jaxops.frac`)
  out = out_proj(rmsnorm(y * silu(z)) * gain)

  alpha_h = alpha_min + (1 - alpha_min) sigmoid(alpha_logit_h) is learnable; at init the
  heads' sigmoids are evenly spaced over [0.15, 0.85] (sigmoid' >= 0.127: every head can
  move), i.e. alpha 0.19-0.86 with the default alpha_min = 0.05 (`ALPHA_MIN`, chosen so that
  this spread is the design's [0.2, 0.9]); or `alpha_init`, clipped to sigmoids in
  [1e-3, 1 - 1e-3]. The modes' rates cover warped times up to 4 * `context`.

  `mamba2=True` is the one-mode exponential layer: one mode of weight 1 and rate
  A_h = exp(log_timescale_h), i.e. Mamba-2's exponential decay exp(-A_h dt_t). No alpha
  parameters then. Its initialisation (`init`):
  - "default": A_h log-spaced over [1/context, 1] across heads (the slowest head's timescale
    is the context, at dt ~ 1), dt as for FRAC;
  - "mamba_ssm": Mamba-2's own (state-spaces/mamba, mamba_ssm/modules/mamba2.py defaults):
    A_h ~ U[1, 16] independently per head (log_timescale = log A_h), and
    dt_h = max(exp(U[log 1e-3, log 1e-1]), 1e-4) through the inverse softplus into dt_bias,
    so each head starts with timescale 1 / (A_h dt_h) between ~0.6 and ~1000 steps.

  `selective_dt=False` makes dt a learned per-head constant, dt_h = softplus(dt_bias_h), the
  same at every token (no dt_proj): the memory clock then runs at a fixed rate whatever the
  input, so the layer's memory is its kernel alone (a selective layer can stop its clock on
  inputs it need not keep). Either layer, FRAC or one-mode.

  Decoding: `init_cache(batch)` and `step(x_t, cache)`; the cache holds the conv window
  and the M * N * P numbers per head of the state, whatever the context length.

  Args:
    d_model, num_heads, head_dim, state_dim: d, H, P, N (d_in = H P). P defaults to
      d / H (d_in = d, so the layer holds about attention's parameters); N to 16, Mamba's
      default (FRAC keeps M N P numbers per head, M times Mamba-2's state at equal N).
    num_modes: M >= 3 (None: from `context`; the Mamba-2 baseline has 1).
    context: the training length; the modes' rates cover warped times up to 4 * context.
    impl: "auto" (default), "pallas" (kernel), "xla" (chunked XLA path) or "reference"
      (sequential scan); see `models.impl`.
    interpret: passed to the Pallas kernel (None: interpret on CPU only).
    backend: force a kernel body, "mosaic", "triton" or "mosaic_gpu" (None: the dispatch's
      choice per chip and dtype; README's table); `models.impl.kernel_body(layer, ...)` says
      which body a call runs.
    learn_timescale: whether log_timescale (init 0 for FRAC) is trained.
    init: "default" or "mamba_ssm" (mamba2=True only); see above.
    selective_dt: False: dt_h = softplus(dt_bias_h), not a function of the input.
    chunk: scan chunk for "pallas"/"xla" (None: the op's default).
    dtype: compute dtype of projections and scan inputs; None uses the input's dtype.
  """

  def __init__(self, d_model: int, *, num_heads: int, head_dim: int | None = None,
               state_dim: int = 16,
               num_modes: int | None = None, context: int = 2048, alpha_min: float = ALPHA_MIN,
               alpha_init: ArrayLike | None = None, conv_width: int = 4, impl: Impl = "auto",
               interpret: Any = None, backend: str | None = None,
               mamba2: bool = False, learn_timescale: bool = True, chunk: int | None = None,
               init: str = "default", selective_dt: bool = True,
               dtype: DTypeLike | None = None, param_dtype: DTypeLike = jnp.float32,
               rngs: nnx.Rngs) -> None:
    checks.ints("FRACMixer", dict(d_model=d_model, num_heads=num_heads))
    if head_dim is None:
      if d_model % num_heads:
        raise ValueError(
            f"FRACMixer: `d_model` ({d_model}) is not a multiple of `num_heads` ({num_heads}), "
            f"so the default head_dim = d_model / num_heads is not whole; pass `head_dim` "
            f"(the inner width is num_heads * head_dim) or a num_heads that divides d_model")
      head_dim = d_model // num_heads
    checks.ints("FRACMixer", dict(head_dim=head_dim, state_dim=state_dim, context=context, conv_width=conv_width,
                                  **checks.given(chunk=chunk)))
    if not mamba2 and num_modes is not None:
      checks.ints("FRACMixer", {"num_modes": num_modes}, minimum=3)
    if not 0.0 < alpha_min < 1.0:
      raise ValueError(f"FRACMixer: `alpha_min` must lie in (0, 1), got {alpha_min}")
    if mamba2 and num_modes not in (None, 1):
      raise ValueError(f"FRACMixer: mamba2=True uses one mode; got num_modes={num_modes}")
    if mamba2 and alpha_init is not None:
      raise ValueError("FRACMixer: mamba2=True has no alpha; do not pass `alpha_init`")
    checks.one_of("FRACMixer", "init", init, INITS)
    if init == "mamba_ssm" and not mamba2:
      raise ValueError("FRACMixer: init='mamba_ssm' initialises the one-mode layer's A_h; it "
                       "needs mamba2=True")
    self.num_heads, self.head_dim, self.state_dim = num_heads, head_dim, state_dim
    self.context, self.alpha_min, self.chunk = context, alpha_min, chunk
    self.impl = resolve_impl("FRACMixer", impl, backend=backend)
    self.interpret, self.backend = interpret, backend
    self.mamba2, self.learn_timescale, self.dtype = mamba2, learn_timescale, dtype
    self.init, self.selective_dt = init, selective_dt
    self.num_modes = 1 if mamba2 else (num_modes or frac_ops.default_num_modes(context))
    d_inner = num_heads * head_dim
    lecun = jax.nn.initializers.lecun_normal()
    # Drawn as Mamba-2's one fused input projection [z | x | B | C | dt] (and one conv over
    # [x | B | C]), stored split by role so that each piece names its head dimension
    # (models.partitioning): under a mesh "tensor" splits the heads, and B, C (shared by all
    # heads) stay whole. in_proj [d, 2, d_in] holds z and x, head-major.
    fused = lecun(rngs.params(), (d_model, 2 * d_inner + 2 * state_dim + num_heads),
                  param_dtype)
    zx, bc, dt_w = jnp.split(fused, [2 * d_inner, 2 * d_inner + 2 * state_dim], axis=1)
    self.in_proj = param(zx.reshape(d_model, 2, d_inner), "embed", None, "heads", cast=True)
    self.bc_proj = param(bc, "embed", "mlp", cast=True)
    self.dt_proj = param(dt_w, "embed", "heads", cast=True) if selective_dt else None
    conv = jax.random.uniform(rngs.params(), (conv_width, d_inner + 2 * state_dim),
                              param_dtype, -1.0, 1.0) / math.sqrt(conv_width)
    self.conv_weight = param(conv[:, :d_inner], None, "head_channels", cast=True)
    self.conv_bias = param(jnp.zeros((d_inner,), param_dtype), "head_channels", cast=True)
    self.bc_conv_weight = param(conv[:, d_inner:], None, "channels", cast=True)
    self.bc_conv_bias = param(jnp.zeros((2 * state_dim,), param_dtype), "channels", cast=True)
    dt = jnp.exp(jax.random.uniform(rngs.params(), (num_heads,), _F32, math.log(0.5),
                                    math.log(2.0)))
    if init == "mamba_ssm":
      dt_key, a_key = jax.random.split(rngs.params())
      lo, hi = MAMBA_SSM_DT_RANGE
      dt = jnp.maximum(jnp.exp(jax.random.uniform(dt_key, (num_heads,), _F32, math.log(lo),
                                                  math.log(hi))), MAMBA_SSM_DT_FLOOR)
      log_a = jnp.log(jax.random.uniform(a_key, (num_heads,), _F32, *MAMBA_SSM_A_RANGE))
    else:
      log_a = jnp.linspace(0.0, -math.log(context), num_heads)
    self.dt_bias = param(_inverse_softplus(dt).astype(param_dtype), "heads")
    if mamba2:
      self.log_timescale = param(log_a.astype(param_dtype), "heads")
      self.alpha_logit = None
    else:
      # numpy: alpha_init is a config value, and the check must also run under jit /
      # nnx.eval_shape, where a jnp comparison would be a tracer.
      if alpha_init is None:
        frac = np.linspace(ALPHA_INIT_SPAN, 1 - ALPHA_INIT_SPAN, num_heads)
      else:
        alpha = np.broadcast_to(np.asarray(alpha_init, np.float32), (num_heads,))
        if not np.all((alpha >= alpha_min) & (alpha <= 1.0)):
          raise ValueError(f"FRACMixer: `alpha_init` must lie in [alpha_min={alpha_min}, 1],"
                           f" got {alpha}")
        frac = np.clip((alpha - alpha_min) / (1 - alpha_min), 1e-3, 1 - 1e-3)
      self.alpha_logit = param(_logit(frac).astype(param_dtype), "heads")
      self.log_timescale = param(jnp.zeros((num_heads,), param_dtype), "heads")
    self.skip = param(jnp.ones((num_heads,), param_dtype), "heads")
    self.norm_gain = param(jnp.ones((d_inner,), param_dtype), "head_channels")
    self.out_proj = param(lecun(rngs.params(), (d_inner, d_model), param_dtype),
                          "heads", "embed", cast=True)

  # --------------------------------------------------------------------------- pieces
  # Head counts below come from the parameters' shapes, not `num_heads`: under
  # partitioning.shard_layer(split_heads=True) the layer holds only its local heads.

  def alpha(self) -> jax.Array:
    """alpha_h in (alpha_min, 1), [H] float32 (1 for the Mamba-2 baseline)."""
    if self.mamba2:
      return jnp.ones(self.log_timescale.shape, _F32)
    logit = self.alpha_logit[...].astype(_F32)
    return self.alpha_min + (1.0 - self.alpha_min) * jax.nn.sigmoid(logit)

  def modes(self) -> tuple[jax.Array, jax.Array]:
    """(rates, weights) [H, M] float32; rates already times exp(log_timescale)."""
    log_timescale = self.log_timescale[...].astype(_F32)
    if not self.learn_timescale:
      log_timescale = jax.lax.stop_gradient(log_timescale)
    if self.mamba2:
      return jnp.exp(log_timescale)[:, None], jnp.ones((log_timescale.shape[0], 1), _F32)
    rates, weights = frac_ops.soe_modes(self.alpha(), num_modes=self.num_modes,
                                        context=self.context)
    return rates * jnp.exp(log_timescale)[:, None], weights

  def _project(self, x):
    """x [..., d] -> (z, x_in [..., d_in], bc [..., 2N] before the conv, dt_raw [..., H]).

    One matmul per piece (not one on the pieces concatenated): each is then column-parallel
    over its own layout under a mesh."""
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    zx = jnp.einsum("...d,dkc->...kc", x, self.in_proj[...].astype(dtype))
    if self.dt_proj is None:                     # selective_dt=False: dt = softplus(dt_bias)
      dt_raw = jnp.zeros(x.shape[:-1] + self.dt_bias.shape, dtype)
    else:
      dt_raw = x @ self.dt_proj[...].astype(dtype)
    return zx[..., 0, :], zx[..., 1, :], x @ self.bc_proj[...].astype(dtype), dt_raw

  @staticmethod
  def _conv(window, weight, bias):
    """Causal depthwise conv + silu: window [B, n + W - 1, D], weight [W, D], bias [D]
    -> [B, n, D]."""
    w = weight[...].astype(window.dtype)
    width, n = w.shape[0], window.shape[1] - w.shape[0] + 1
    out = sum(window[:, k:k + n] * w[k] for k in range(width))
    return jax.nn.silu(out + bias[...].astype(window.dtype))

  def _scan_inputs(self, xs, bc, dt_raw):
    """Conv outputs xs [..., d_in], bc [..., 2N] -> x [..., H, P], dt [..., H] float32,
    b, c [..., H, N] (shared by the heads)."""
    n, h = self.state_dim, dt_raw.shape[-1]
    b, c = jnp.split(bc, [n], axis=-1)
    xs = xs.reshape(*xs.shape[:-1], h, self.head_dim)
    b, c = (jnp.broadcast_to(v[..., None, :], (*v.shape[:-1], h, n)) for v in (b, c))
    dt = jax.nn.softplus(dt_raw.astype(_F32) + self.dt_bias[...].astype(_F32))
    return xs, dt, b, c

  def _gated_norm(self, y):
    """RMS normalization of y [..., d_in] float32 over all H P channels. With the heads split
    over "tensor" (y holds the local ones) the mean square is summed across the split."""
    d_inner = self.num_heads * self.head_dim
    if y.shape[-1] == d_inner:
      return rms_normalize(y)
    total = partitioning.psum_heads(jnp.sum(y * y, axis=-1, keepdims=True))
    return y * jax.lax.rsqrt(total / d_inner + 1e-6)

  def _output(self, y, xs, z):
    """D skip, gated RMSNorm (of y * silu(z)), out_proj: y, xs [..., H, P], z [..., d_in]."""
    y = y.astype(_F32) + self.skip[...].astype(_F32)[:, None] * xs.astype(_F32)
    y = y.reshape(z.shape) * jax.nn.silu(z.astype(_F32))
    y = (self._gated_norm(y) * self.norm_gain[...].astype(_F32)).astype(z.dtype)
    return y @ self.out_proj[...].astype(z.dtype)

  def _convolve(self, xs, bc):
    """The causal conv of the x and the B, C channels: windows [B, n + W - 1, .] each."""
    return (self._conv(xs, self.conv_weight, self.conv_bias),
            self._conv(bc, self.bc_conv_weight, self.bc_conv_bias))

  # --------------------------------------------------------------------------- API

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, L, d] -> [B, L, d] in the compute dtype."""
    return self._output(*self.scan_output(x))

  def scan_output(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer up to the scan: x [B, L, d] -> (y, x_in [B, L, H, P], z [B, L, d_in]), what
    `_output` takes (`__call__` is the two; benchmarks/aot/perf_programs profiles them apart)."""
    checks.sequence("FRACMixer", "x", x, self.in_proj.shape[0])
    z, xs, bc, dt_raw = self._project(x)
    causal = ((0, 0), (self.conv_weight.shape[0] - 1, 0), (0, 0))
    xs, bc = self._convolve(jnp.pad(xs, causal), jnp.pad(bc, causal))
    xs, dt, b, c = self._scan_inputs(xs, bc, dt_raw)
    rates, weights = self.modes()
    y, _ = impl_table.call("frac_scan", self.impl, xs, dt, b, c, rates, weights,
                           chunk=self.chunk, interpret=self.interpret, backend=self.backend)
    return y, xs, z

  def init_cache(self, batch: int, dtype: DTypeLike | None = None) -> dict[str, jax.Array]:
    """Decoding cache: the conv windows of x [B, W - 1, d_in] and of B, C [B, W - 1, 2N], and
    the state [B, H, M, N, P]."""
    checks.ints("FRACMixer.init_cache", {"batch": batch})
    dtype = dtype or self.dtype or self.in_proj[...].dtype
    window = self.conv_weight.shape[0] - 1
    return {
        "conv_x": jnp.zeros((batch, window, self.conv_weight.shape[1]), dtype),
        "conv_bc": jnp.zeros((batch, window, self.bc_conv_weight.shape[1]), dtype),
        "state": jnp.zeros((batch, self.num_heads, self.num_modes, self.state_dim,
                            self.head_dim), _F32),
    }

  def _check_cache(self, cache, batch: int) -> None:
    """ValueError unless `cache` has the entries and shapes of init_cache(batch)."""
    made = jax.eval_shape(lambda: self.init_cache(batch))
    expected = {k: v.shape for k, v in sorted(made.items())}
    got = ({k: getattr(v, "shape", type(v).__name__) for k, v in sorted(cache.items())}
           if isinstance(cache, dict) else type(cache).__name__)
    if got != expected:
      raise ValueError(f"FRACMixer.step: `cache` has shapes {got}, expected {expected} for x_t "
                       f"of batch {batch}: make it with init_cache(batch={batch})")

  def step(self, x_t: jax.Array,
           cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One token: x_t [B, d] -> (y_t [B, d], cache); equals __call__ token by token."""
    d_model = self.in_proj.shape[0]
    checks.shape("FRACMixer.step", "x_t", x_t, (None, d_model), f"[B, d_model={d_model}]")
    checks.floating("FRACMixer.step", "x_t", x_t)
    self._check_cache(cache, x_t.shape[0])
    z, xs, bc, dt_raw = self._project(x_t)
    win_x, win_bc = (jnp.concatenate([cache[k].astype(v.dtype), v[:, None]], axis=1)
                     for k, v in (("conv_x", xs), ("conv_bc", bc)))
    xs, bc = (v[:, 0] for v in self._convolve(win_x, win_bc))
    xs, dt, b, c = self._scan_inputs(xs, bc, dt_raw)
    y, state = frac_ops.frac_step(cache["state"], xs, dt, b, c, *self.modes())
    return self._output(y, xs, z), {"conv_x": win_x[:, 1:].astype(cache["conv_x"].dtype),
                                    "conv_bc": win_bc[:, 1:].astype(cache["conv_bc"].dtype),
                                    "state": state}
