"""FRAC: a selective SSM whose memory decays as a power law (DESIGN.md section 4).

Power-law memory from exponential modes. For 0 < alpha <= 1 and warped time u >= 0::

  (1 + u)^(-alpha) = 1/Gamma(alpha) int_0^inf s^(alpha-1) e^(-s) e^(-s u) ds
                   ~ sum_j w_j exp(-s_j u)

`soe_modes` discretizes the integral (trapezoid rule in log s, see there). Each head
h then runs M diagonal scans that share their input and differ only in their rate
(x_t [P], B_t, C_t [N], dt_t > 0 per head; S^j [N, P])::

  S^j_t = exp(-r_hj dt_t) S^j_{t-1} + dt_t B_t x_t^T          j = 1..M
  y_t   = sum_j w_hj C_t^T S^j_t

so y_t = sum_{tau<=t} K_h(T_t - T_tau) (C_t . B_tau) dt_tau x_tau + (initial-state terms),
with T the cumulative dt ("warped time") and K_h(u) = sum_j w_hj exp(-r_hj u). One mode of
weight 1 is Mamba-2's exponential decay.

Shapes (Bt batch, L tokens, H heads, P head width, N state width, M modes):

  x [Bt, L, H, P]   dt [Bt, L, H]   b, c [Bt, L, H, N]   rates, weights [H, M]
  state [Bt, H, M, N, P] (float32)

`frac_scan_reference` is the recurrence as a sequential loop of `frac_step`;
`frac_scan` is the chunked parallel form (below); the Pallas kernel is
`pallas_kernels.frac_scan`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.frac_chunk import Modes, TilePlan, chunk_backward, chunk_forward

_F32 = jnp.float32

# Rates covered by the log-spaced grid: [S_LOW / context, S_HIGH]. Faster modes would
# decay within a fraction of one unit of warped time (a skip term's job).
S_LOW, S_HIGH = 0.03, 4.0


# ----------------------------------------------------------------------------
# Modes.
# ----------------------------------------------------------------------------

def default_num_modes(context: int) -> int:
  """Modes for step h <= 1 over [S_LOW/context, S_HIGH]: ceil(ln(S_HIGH context/S_LOW)) + 2.

  The grid has ceil(ln(...)) + 1 points plus one tail mode: 16 at 8k, 20 at 256k.
  """
  return math.ceil(math.log(S_HIGH * context / S_LOW)) + 2


def soe_modes(alpha: ArrayLike, *, num_modes: int | None = None, context: int,
              kernel: str = "power") -> tuple[jax.Array, jax.Array]:
  """Sum-of-exponentials fit of a completely monotone memory kernel.

  Rates s_j = s_min e^(j h), j = 0..G-1, span [s_min, s_max] = [S_LOW/context, S_HIGH]
  (G = num_modes - 1 points, step h = ln(s_max/s_min)/(G-1)). Writing the target as
  int_0^inf rho(s) e^(-s u) ds, the trapezoid rule in log s gives w_j = h s_j rho(s_j);
  one tail mode stands for all rates in [0, b], b = s_min e^(-h/2), with weight
  int_0^b rho(s) ds and the mean rate there (rho ~ s^(alpha-1) near 0):

  - kernel="power", (1 + u)^(-alpha): rho(s) = s^(alpha-1) e^(-s) / Gamma(alpha), so
    w_j = h exp(alpha ln s_j - s_j - lnGamma(alpha)); tail weight b^alpha/Gamma(alpha+1),
    tail rate b alpha/(alpha+1). Within 0.2% of the target for u <= context and 0.4%
    for u <= 4 context when alpha is in [0.2, 0.8] (both tested).
  - kernel="mittag_leffler", the relaxation E_alpha(-u^alpha) (alpha < 1):
    rho(s) = sin(pi alpha) s^(alpha-1) / (pi (s^(2 alpha) + 2 s^alpha cos(pi alpha) + 1)).
    Its spectrum has mass sin(pi alpha) s_max^(-alpha) / (pi alpha) above s_max, rates
    that die within one step; that mass is left to the layer's skip term, so the fit
    is accurate for u >= 1.

  Args:
    alpha: exponent(s), any shape [...], in (0, 1]; differentiable.
    num_modes: M >= 3 (G = M - 1 grid rates plus the tail); None: `default_num_modes`.
    context: the longest warped time the fit must cover is 4 * context.
    kernel: "power" or "mittag_leffler".

  Returns:
    (rates, weights), both [..., M] float32, rates ascending (the tail mode first).
  """
  checks.one_of("soe_modes", "kernel", kernel, ("power", "mittag_leffler"))
  checks.ints("soe_modes", {"context": context})
  num_modes = default_num_modes(context) if num_modes is None else num_modes
  checks.ints("soe_modes", {"num_modes": num_modes}, minimum=3)
  upper = 1.0 if kernel == "power" else 1.0 - 1e-6
  checks.values("soe_modes", "alpha", alpha,
                lambda a: (a > 0) & (a <= upper),
                "lie in (0, 1]" + ("" if kernel == "power" else " and below 1 for mittag_leffler"))
  alpha = jnp.asarray(alpha, _F32)[..., None]
  grid = num_modes - 1
  s_min = S_LOW / context
  h = math.log(S_HIGH / s_min) / (grid - 1)
  log_s = jnp.asarray(math.log(s_min) + h * np.arange(grid), _F32)
  b = s_min * math.exp(-h / 2)
  if kernel == "power":
    log_w = alpha * log_s - jnp.exp(log_s) - jax.scipy.special.gammaln(alpha)
    weights = h * jnp.exp(log_w)
    tail = jnp.exp(alpha * math.log(b) - jax.scipy.special.gammaln(alpha + 1))
  else:
    sin, cos = jnp.sin(jnp.pi * alpha), jnp.cos(jnp.pi * alpha)
    s_a = jnp.exp(alpha * log_s)
    weights = h * sin / jnp.pi * s_a / (s_a * s_a + 2 * s_a * cos + 1)
    tail = sin / (jnp.pi * alpha) * jnp.exp(alpha * math.log(b))
  rates = jnp.broadcast_to(jnp.exp(log_s), weights.shape)
  tail_rate = b * alpha / (alpha + 1)
  return (jnp.concatenate([tail_rate, rates], axis=-1),
          jnp.concatenate([tail, weights], axis=-1))


def soe_kernel(rates: jax.Array, weights: jax.Array, u: jax.Array) -> jax.Array:
  """K(u) = sum_j weights_j exp(-rates_j u): rates, weights [..., M], u [K] -> [..., K]."""
  return jnp.sum(weights[..., None, :] * jnp.exp(-rates[..., None, :] * u[:, None]), axis=-1)


# ----------------------------------------------------------------------------
# Input checks shared by every scan path (the kernel's too).
# ----------------------------------------------------------------------------

def check_scan_inputs(x: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array,
                      rates: jax.Array, weights: jax.Array,
                      initial_state: jax.Array | None = None, *,
                      name: str = "frac_scan") -> None:
  """Raises (see `jaxops.checks`) naming the argument when shapes, dtypes or values do not fit.

  dt must be > 0, rates >= 0, weights finite: checked when concrete, and by
  `checkify.debug_check` under jit.
  """
  for arg, a, rank in (("x", x, 4), ("dt", dt, 3), ("b", b, 4), ("c", c, 4),
                       ("rates", rates, 2), ("weights", weights, 2)):
    if a.ndim != rank:
      raise ValueError(f"{name}: `{arg}` must have rank {rank}, got shape {tuple(a.shape)}")
    checks.floating(name, arg, a)
  checks.nonempty(name, "x", x, "[Bt, L, H, P]")
  checks.nonempty(name, "b", b, "[Bt, L, H, N]")
  checks.nonempty(name, "rates", rates, "[H, M]")
  batch, length, heads, _ = x.shape
  if dt.shape != (batch, length, heads):
    raise ValueError(f"{name}: `dt` has shape {tuple(dt.shape)}; expected [Bt, L, H] ="
                     f" {(batch, length, heads)} from x {tuple(x.shape)}")
  if b.shape[:3] != (batch, length, heads):
    raise ValueError(f"{name}: `b` has shape {tuple(b.shape)}; expected [Bt, L, H, N] with"
                     f" [Bt, L, H] = {(batch, length, heads)} from x {tuple(x.shape)}")
  if c.shape != b.shape:
    raise ValueError(f"{name}: `c` has shape {tuple(c.shape)}; expected the shape of b"
                     f" {tuple(b.shape)}")
  if rates.shape[0] != heads:
    raise ValueError(f"{name}: `rates` has shape {tuple(rates.shape)}; expected [H={heads}, M]")
  if weights.shape != rates.shape:
    raise ValueError(f"{name}: `weights` has shape {tuple(weights.shape)}; expected the shape"
                     f" of rates {tuple(rates.shape)}")
  expected = (batch, heads, rates.shape[1], b.shape[3], x.shape[3])
  if initial_state is not None and initial_state.shape != expected:
    raise ValueError(f"{name}: `initial_state` has shape {tuple(initial_state.shape)};"
                     f" expected [Bt, H, M, N, P] = {expected}")
  # dt <= 0 turns the decays exp(-rate dt) into growth (1e11-sized outputs).
  checks.values(name, "dt", dt, lambda v: (v > 0) & checks.finite(v), "be > 0 and finite")
  checks.values(name, "rates", rates, lambda v: (v >= 0) & checks.finite(v), "be >= 0 and finite")
  checks.values(name, "weights", weights, checks.finite, "be finite")


def zero_state(x: jax.Array, b: jax.Array, rates: jax.Array) -> jax.Array:
  """The zero initial state [Bt, H, M, N, P] float32 for these inputs."""
  batch, _, heads, p = x.shape
  return jnp.zeros((batch, heads, rates.shape[1], b.shape[3], p), _F32)


# ----------------------------------------------------------------------------
# Sequential reference and decoding.
# ----------------------------------------------------------------------------

def frac_step(state: jax.Array, x_t: jax.Array, dt_t: jax.Array, b_t: jax.Array, c_t: jax.Array,
              rates: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One step of the recurrence (decoding).

  Args:
    state: [Bt, H, M, N, P]; x_t [Bt, H, P]; dt_t [Bt, H]; b_t, c_t [Bt, H, N];
      rates, weights [H, M].

  Returns:
    (y_t [Bt, H, P] in x_t.dtype, state float32).
  """
  for arg, a, rank in (("state", state, 5), ("x_t", x_t, 3), ("dt_t", dt_t, 2), ("b_t", b_t, 3),
                       ("c_t", c_t, 3)):
    if a.ndim != rank:
      raise ValueError(f"frac_step: `{arg}` must have rank {rank}, got shape {tuple(a.shape)}")
  # The step is a scan of length 1: the same checks (they name x, dt, b, c for x_t, ...).
  check_scan_inputs(x_t[:, None], dt_t[:, None], b_t[:, None], c_t[:, None], rates, weights,
                    state, name="frac_step")
  return _step(state, x_t, dt_t, b_t, c_t, rates, weights)


def _step(state, x_t, dt_t, b_t, c_t, rates, weights):
  x32, dt32, b32, c32 = (a.astype(_F32) for a in (x_t, dt_t, b_t, c_t))
  decay = jnp.exp(-rates.astype(_F32) * dt32[..., None])                  # [Bt, H, M]
  update = jnp.einsum("bh,bhn,bhp->bhnp", dt32, b32, x32)
  state = decay[..., None, None] * state.astype(_F32) + update[:, :, None]
  y = jnp.einsum("hm,bhn,bhmnp->bhp", weights.astype(_F32), c32, state)
  return y.astype(x_t.dtype), state


def frac_scan_reference(x: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array,
                        rates: jax.Array, weights: jax.Array,
                        initial_state: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The recurrence as a plain sequential float32 loop over tokens.

  Returns:
    (y [Bt, L, H, P] in x.dtype, final state [Bt, H, M, N, P] float32).
  """
  check_scan_inputs(x, dt, b, c, rates, weights, initial_state, name="frac_scan_reference")
  state = zero_state(x, b, rates) if initial_state is None else initial_state.astype(_F32)

  def step(state, inputs):
    y_t, state = _step(state, *inputs, rates, weights)
    return state, y_t

  time_major = lambda a: jnp.moveaxis(a.astype(_F32), 1, 0)
  state, y = jax.lax.scan(step, state, tuple(map(time_major, (x, dt, b, c))))
  return jnp.moveaxis(y, 0, 1).astype(x.dtype), state


# ----------------------------------------------------------------------------
# Chunked XLA path.
# ----------------------------------------------------------------------------

def _to_chunks(plan: TilePlan, a):
  """[G, Lp, X] -> [C, G, Q, X]: chunks first, for lax.scan."""
  return jnp.moveaxis(a.reshape(a.shape[0], plan.num_chunks, plan.chunk, -1), 1, 0)


def _from_chunks(plan: TilePlan, a):
  """Inverse of `_to_chunks`."""
  return jnp.moveaxis(a, 0, 1).reshape(a.shape[1], plan.length, -1)


def _per_mode(plan: TilePlan, state):
  """[G, M * n, p] -> M arrays [G, n, p]."""
  return list(jnp.moveaxis(state.reshape(state.shape[0], plan.m_pad, plan.n, -1), 1, 0))


def _stacked(states):
  """Inverse of `_per_mode`."""
  return jnp.concatenate(states, axis=1)


def _scan_chunks(plan: TilePlan, x, bd, c, t, modes: Modes, state, *, save_starts):
  """Forward over chunks in tile layout: (y [G, Lp, P], final state, chunk-start states)."""
  to_chunks = functools.partial(_to_chunks, plan)
  forward = jax.vmap(chunk_forward)

  def body(state, xs):
    y, states = forward(*xs, modes, _per_mode(plan, state))
    return _stacked(states), (y, state)

  state, (y, starts) = jax.lax.scan(body, state, tuple(map(to_chunks, (x, bd, c, t))))
  return _from_chunks(plan, y), state, starts if save_starts else None


def _unscan_chunks(plan: TilePlan, x, bd, c, t, modes: Modes, starts, dy, dstate):
  """Backward over chunks, last first, from the saved chunk-start states."""
  to_chunks = functools.partial(_to_chunks, plan)
  backward = jax.vmap(chunk_backward)

  def body(dstate, xs):
    *tiles, start, dy = xs
    dx, dbd, dc, dt, dmodes, dstates = backward(*tiles, modes, _per_mode(plan, start), dy,
                                                _per_mode(plan, dstate))
    return _stacked(dstates), (dx, dbd, dc, dt, dmodes)

  xs = (*map(to_chunks, (x, bd, c, t)), starts, to_chunks(dy))
  dstate, (dx, dbd, dc, dt, dmodes) = jax.lax.scan(body, dstate, xs, reverse=True)
  dmodes = jax.tree.map(lambda a: jnp.sum(a, axis=0), dmodes)
  return (*(_from_chunks(plan, a) for a in (dx, dbd, dc, dt)), dmodes, dstate)


# The name (`jax.ad_checkpoint.checkpoint_name`) of what a differentiated scan computes: its
# output, end state and chunk-start states (the backward's residuals). A remat policy that
# saves it (`jax.checkpoint_policies.save_only_these_names`) keeps the scan out of the
# recomputation.
CHECKPOINT_NAME = "frac_scan"


def scan_vjp(plan: TilePlan, forward: Callable[..., tuple],
             backward: Callable[..., tuple]) -> Callable[..., tuple[jax.Array, jax.Array]]:
  """A differentiable scan from tile-level forward/backward functions (XLA or kernels).

  forward(x, bd, c, t, modes, state, *, save_starts) -> (y, state, starts or None) and
  backward(x, bd, c, t, modes, starts, dy, dstate) -> (dx, dbd, dc, dt, dmodes, dstate)
  work in the tile plan `plan`; the layout change itself (padding, cumulative dt,
  bd = dt b, per-group mode rows) is differentiated by JAX.
  Returns f(x, dt, b, c, rates, weights, state) -> (y, state).
  """
  @jax.custom_vjp
  def scan(*args):
    y, state, _ = forward(*plan.tiles(*args), save_starts=False)
    return plan.untile(y, state, *_shape_args(args))

  def fwd(*args):
    y, state, starts = forward(*plan.tiles(*args), save_starts=True)
    y, state, starts = checkpoint_name((y, state, starts), CHECKPOINT_NAME)
    return plan.untile(y, state, *_shape_args(args)), (args, starts)

  def bwd(residuals, cotangents):
    args, starts = residuals
    tiles, tiles_vjp = jax.vjp(plan.tiles, *args)
    x, bd, c, t, modes, state = tiles
    untile = lambda y, s: plan.untile(y, s, *_shape_args(args))
    dy, dstate = jax.linear_transpose(untile, jnp.zeros(x.shape[:2] + (plan.p,), _F32),
                                      state)(cotangents)
    grads = backward(x, bd, c, t, modes, starts, dy, dstate)
    return tiles_vjp(jax.tree.map(lambda g, a: g.astype(a.dtype), grads, tiles))

  scan.defvjp(fwd, bwd)
  return scan


def _shape_args(args):
  x, _, b, _, rates = args[:5]
  return x, b, rates


def frac_scan(x: jax.Array, dt: jax.Array, b: jax.Array, c: jax.Array, rates: jax.Array,
              weights: jax.Array, initial_state: jax.Array | None = None, *,
              chunk: int = 64) -> tuple[jax.Array, jax.Array]:
  """Chunked parallel form of `frac_scan_reference`: same arguments and result.

  Tokens are cut into chunks of `chunk`; inside a chunk the M modes fold into one
  decay matrix (`jaxops.frac_chunk`), across chunks a `lax.scan` carries the M states.
  The backward pass walks the chunks in reverse from the saved chunk-start states,
  recomputing inside each chunk (custom VJP, the kernel's tile math). Any L.
  """
  check_scan_inputs(x, dt, b, c, rates, weights, initial_state)
  checks.ints("frac_scan", {"chunk": chunk})
  state = zero_state(x, b, rates) if initial_state is None else initial_state.astype(_F32)
  plan = TilePlan.make(x, b, rates, chunk=chunk)
  scan = scan_vjp(plan, functools.partial(_scan_chunks, plan),
                  functools.partial(_unscan_chunks, plan))
  return scan(x, dt, b, c, rates, weights, state)
