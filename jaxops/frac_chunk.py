"""One chunk of the FRAC scan, forward and backward, as 2-D tile math; and the tile layout.

The chunked XLA path (`jaxops.frac.frac_scan`, vmapped over groups) and both Pallas
kernels (`pallas_kernels.frac_scan`, Mosaic and Triton) run these same functions. They
use only ops both Pallas backends lower: 2-D matmuls, elementwise math, masked row and
column sums (no cumsum, no slicing of values, no integer division).

One group g = (batch element, head) and one chunk of Q tokens. With M modes and the
state's N rows folded into K = M * N ("mode-major": k = j * N + n)::

  x [Q, P]     bd [Q, N] = dt * b     c [Q, N]     t [Q, 1] = sum_{s<=t} dt_s (in the chunk)
  state [K, P] (float32; row j * N + n is row n of S^j)

  Lmix[t, tau] = sum_j w_j exp(-r_j (t_t - t_tau))                    tau <= t, else 0
  y     = ((c bd^T) * Lmix) x  +  ((c R) * w_k exp(-r_k t)) state
  state <- exp(-r_k t_Q) * state  +  ((bd R) * exp(-r_k (t_Q - t)))^T x

R [N, K] (R[n, j N + n] = 1) repeats c and bd once per mode; r_k, w_k are the rates and
weights repeated the same way. Every exponent is -rate * (a difference of cumulative dt)
<= 0, so nothing overflows; the modes meet in Lmix only, so the Q x Q part costs what a
single mode costs and the M modes only widen the state contraction.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxops import tiling

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


class Modes(NamedTuple):
  """Rates and weights of one group in the forms the tile math reads them."""

  rate_row: jax.Array     # [1, M]
  weight_row: jax.Array   # [1, M]
  rate_rep: jax.Array     # [1, K]  rate of mode j at k = j * N + n
  weight_rep: jax.Array   # [1, K]
  rate_col: jax.Array     # [K, 1]


# ----------------------------------------------------------------------------
# Small helpers that lower in Mosaic and Triton alike.
# ----------------------------------------------------------------------------

_dot = functools.partial(tiling.dot, precision=_HIGHEST)
_dot_nt = functools.partial(tiling.dot_nt, precision=_HIGHEST)  # a @ b^T
_dot_tn = functools.partial(tiling.dot_tn, precision=_HIGHEST)  # a^T @ b


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _eye(q):
  return _iota((q, q), 0) == _iota((q, q), 1)


def _to_row(col):
  """[Q, 1] -> [1, Q], a transpose written as a masked column sum."""
  return jnp.sum(jnp.where(_eye(col.shape[0]), col, 0.0), axis=0, keepdims=True)


def _to_col(row):
  """[1, Q] -> [Q, 1]."""
  return jnp.sum(jnp.where(_eye(row.shape[1]), row, 0.0), axis=1, keepdims=True)


def _total(a):
  """Sum of a 2-D array as [1, 1]."""
  return jnp.sum(jnp.sum(a, axis=1, keepdims=True), axis=0, keepdims=True)


def _entry(row, j):
  """row[0, j] as [1, 1]."""
  return jnp.sum(jnp.where(_iota(row.shape, 1) == j, row, 0.0), axis=1, keepdims=True)


def _last(col):
  """col[-1] as [1, 1]."""
  return jnp.sum(jnp.where(_iota(col.shape, 0) == col.shape[0] - 1, col, 0.0), axis=0,
                 keepdims=True)


class _Chunk(NamedTuple):
  """Quantities of one chunk that forward and backward both use."""

  causal: jax.Array  # [Q, Q] bool
  delta: jax.Array   # [Q, Q] t_t - t_tau on and below the diagonal, 0 above
  t_end: jax.Array   # [1, 1]
  lmix: jax.Array    # [Q, Q]
  grow: jax.Array    # [Q, K] exp(-r_k t): decay from the chunk start to token t
  into: jax.Array    # [Q, K] w_k exp(-r_k t)
  out_of: jax.Array  # [Q, K] exp(-r_k (t_Q - t)): decay from token t to the chunk end
  keep: jax.Array    # [K, 1] exp(-r_k t_Q)


def _mix(delta, modes: Modes):
  """Lmix before masking: sum_j w_j exp(-r_j delta) (M static, unrolled)."""
  out = jnp.zeros_like(delta)
  for j in range(modes.rate_row.shape[1]):
    out += _entry(modes.weight_row, j) * jnp.exp(-_entry(modes.rate_row, j) * delta)
  return out


def _prepare(t, modes: Modes) -> _Chunk:
  q = t.shape[0]
  causal = _iota((q, q), 0) >= _iota((q, q), 1)
  t_end = _last(t)
  delta = jnp.where(causal, t - _to_row(t), 0.0)
  grow = jnp.exp(-modes.rate_rep * t)
  return _Chunk(causal, delta, t_end, jnp.where(causal, _mix(delta, modes), 0.0), grow,
                modes.weight_rep * grow, jnp.exp(-modes.rate_rep * (t_end - t)),
                jnp.exp(-modes.rate_col * t_end))


# ----------------------------------------------------------------------------
# Forward and backward of one chunk.
# ----------------------------------------------------------------------------

def chunk_forward(x, bd, c, t, modes: Modes, rep, state):
  """One chunk: returns (y [Q, P] float32, state at the chunk end [K, P] float32)."""
  x, bd, c = (a.astype(_F32) for a in (x, bd, c))
  k = _prepare(t, modes)
  y = _dot(_dot_nt(c, bd) * k.lmix, x) + _dot(_dot(c, rep) * k.into, state)
  state = k.keep * state + _dot_tn(_dot(bd, rep) * k.out_of, x)
  return y, state


def _mix_backward(delta, dlmix, modes: Modes):
  """Cotangents of delta, rate_row and weight_row from the cotangent of Lmix."""
  m = modes.rate_row.shape[1]
  ddelta = jnp.zeros_like(delta)
  drate = dweight = jnp.zeros((1, m), _F32)
  for j in range(m):
    rate, weight = _entry(modes.rate_row, j), _entry(modes.weight_row, j)
    g = dlmix * jnp.exp(-rate * delta)
    onehot = _iota((1, m), 1) == j
    dweight += jnp.where(onehot, _total(g), 0.0)
    drate -= jnp.where(onehot, weight * _total(g * delta), 0.0)
    ddelta -= (weight * rate) * g
  return ddelta, drate, dweight


def chunk_backward(x, bd, c, t, modes: Modes, rep, state, dy, dstate):
  """Reverse of `chunk_forward` given the state at the chunk start.

  Args:
    dy: [Q, P] cotangent of y; dstate: [K, P] cotangent of the state at the chunk end.

  Returns:
    (dx, dbd, dc, dt, dmodes, dstate at the chunk start), all float32; dt is the
    cotangent of t (the in-chunk cumulative dt) and dmodes a `Modes` of cotangents.
  """
  x, bd, c = (a.astype(_F32) for a in (x, bd, c))
  k = _prepare(t, modes)
  cb, c_rep, bd_rep = _dot_nt(c, bd), _dot(c, rep), _dot(bd, rep)
  d_in = _dot_nt(dy, state)        # d(c_rep * into)    [Q, K]
  d_out = _dot_nt(x, dstate)       # d(bd_rep * out_of) [Q, K]
  dscores = _dot_nt(dy, x)         # d(cb * lmix)       [Q, Q]
  dcb = dscores * k.lmix
  dx = _dot_tn(cb * k.lmix, dy) + _dot(bd_rep * k.out_of, dstate)
  dc = _dot(dcb, bd) + _dot_nt(d_in * k.into, rep)
  dbd = _dot_tn(dcb, c) + _dot_nt(d_out * k.out_of, rep)
  dstate_start = k.keep * dstate + _dot_tn(c_rep * k.into, dy)

  # Rates, weights and warped time: g_* is (cotangent of a decay) * (that decay).
  g_in = d_in * c_rep * k.into
  g_out = d_out * bd_rep * k.out_of
  g_keep = jnp.sum(state * dstate, axis=1, keepdims=True) * k.keep       # [K, 1]
  ddelta, drate_row, dweight_row = _mix_backward(
      k.delta, jnp.where(k.causal, dscores * cb, 0.0), modes)
  drate_rep = -jnp.sum(g_in * t + g_out * (k.t_end - t), axis=0, keepdims=True)
  dweight_rep = jnp.sum(d_in * c_rep * k.grow, axis=0, keepdims=True)
  drate_col = -k.t_end * g_keep
  dt_end = -_total(g_out * modes.rate_rep) - jnp.sum(modes.rate_col * g_keep, axis=0,
                                                     keepdims=True)
  dt = (jnp.sum((g_out - g_in) * modes.rate_rep, axis=1, keepdims=True)
        + jnp.sum(ddelta, axis=1, keepdims=True)
        - _to_col(jnp.sum(ddelta, axis=0, keepdims=True))
        + jnp.where(_iota(t.shape, 0) == t.shape[0] - 1, dt_end, 0.0))
  dmodes = Modes(drate_row, dweight_row, drate_rep, dweight_rep, drate_col)
  return dx, dbd, dc, dt, dmodes, dstate_start


# ----------------------------------------------------------------------------
# Layout: [Bt, L, H, X] <-> per-group tiles [G, Lp, X'], G = Bt * H.
# ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TileLayout:
  """Chunk size and padded extents: L -> length (a multiple of chunk), P, N, M -> p, n, m.

  Padding is inert: padded tokens have dt = 0 and x = b = c = 0, padded modes have
  rate = weight = 0 and padded rows of b, c and the state are zero.
  """

  chunk: int
  length: int
  p: int
  n: int
  m: int

  @classmethod
  def make(cls, x, b, rates, *, chunk: int, pow2: bool = False) -> "TileLayout":
    """pow2: widths rounded up to powers of two >= 16 (Triton's rule; Mosaic accepts it)."""
    _, length, _, p = x.shape
    n, m = b.shape[3], rates.shape[1]
    if pow2:
      up = tiling.next_pow2
      chunk, p, n, m = up(chunk), up(p), up(n), up(m, minimum=1)
    chunk = min(chunk, tiling.next_pow2(length, 16) if pow2 else length)
    return cls(chunk, tiling.round_up(length, chunk), p, n, m)

  @property
  def num_chunks(self) -> int:
    return self.length // self.chunk

  def rep(self):
    """R [n, m * n]: R[i, j * n + i] = 1."""
    k = jnp.arange(self.m * self.n)
    return (k[None, :] % self.n == jnp.arange(self.n)[:, None]).astype(_F32)

  def _groups(self, a, width):
    """[Bt, L, H, X] -> [G, length, width], zero-padded."""
    batch, length, heads, x_width = a.shape
    a = jnp.moveaxis(a, 2, 1).reshape(batch * heads, length, x_width)
    return jnp.pad(a, ((0, 0), (0, self.length - length), (0, width - x_width)))

  def tiles(self, x, dt, b, c, rates, weights, state):
    """Inputs in tile layout: (x, bd, c, t, modes, state), t and bd float32."""
    batch = x.shape[0]
    dt = self._groups(dt.astype(_F32)[..., None], 1)
    t = jnp.cumsum(dt.reshape(-1, self.num_chunks, self.chunk), axis=-1).reshape(dt.shape)
    bd = self._groups(b.astype(_F32), self.n) * dt

    def per_group(v):  # [H, M] -> [G, m]
      v = jnp.pad(v.astype(_F32), ((0, 0), (0, self.m - v.shape[1])))
      return jnp.broadcast_to(v, (batch,) + v.shape).reshape(-1, self.m)

    rate, weight = per_group(rates), per_group(weights)
    rate_rep, weight_rep = (jnp.repeat(v, self.n, axis=1)[:, None] for v in (rate, weight))
    modes = Modes(rate[:, None], weight[:, None], rate_rep, weight_rep,
                  jnp.moveaxis(rate_rep, 1, 2))
    m, n, p = state.shape[2:]
    state = jnp.pad(state.astype(_F32), ((0, 0),) * 2 + ((0, self.m - m), (0, self.n - n),
                                                           (0, self.p - p)))
    return (self._groups(x, self.p), bd, self._groups(c, self.n), t, modes,
            state.reshape(-1, self.m * self.n, self.p))

  def untile(self, y, state, x, b, rates):
    """(y [G, length, p], state [G, m * n, p]) -> (y [Bt, L, H, P], state [Bt, H, M, N, P])."""
    batch, length, heads, p = x.shape
    y = y[:, :length, :p].reshape(batch, heads, length, p)
    state = state.reshape(batch, heads, self.m, self.n, self.p)
    return (jnp.moveaxis(y, 1, 2).astype(x.dtype),
            state[:, :, :rates.shape[1], :b.shape[3], :p])
