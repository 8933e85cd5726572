"""One chunk of the FRAC scan, forward and backward, as 2-D tile math; and the tile plan.

The chunked XLA path (`jaxops.frac.frac_scan`, vmapped over groups) and the Mosaic and
Triton kernels (`pallas_kernels.frac_scan`) run these same functions (the Mosaic GPU kernel
computes the same terms in its own transposed WGMMA tiles:
`pallas_kernels/frac_scan/mosaic_gpu.py`). They use only ops both Pallas backends lower: 2-D
matmuls, elementwise math, masked row and column sums (no cumsum, no slicing of values, no
integer division).

One group g = (batch element, head), one chunk of Q tokens and one block of p columns
of the head width P (the columns are independent: Triton splits them across programs to
keep each program's state in registers)::

  x [Q, p]   bd [Q, N] = dt * b   c [Q, N]   t [Q, 1] = sum_{s<=t} dt_s (in the chunk)
  S_j [N, p] (float32), one per mode j = 0..M-1, with rate r_j and weight w_j

  Lmix[t, tau] = sum_j w_j exp(-r_j (t_t - t_tau))                    tau <= t, else 0
  y     = ((c bd^T) * Lmix) x  +  sum_j (c * w_j e^{-r_j t}) S_j
  S_j  <- e^{-r_j t_Q} S_j  +  (bd * e^{-r_j (t_Q - t)})^T x

Every exponent is -rate * (a difference of cumulative dt) <= 0, so nothing overflows.
The modes meet in Lmix only, so the Q x Q part costs what one mode costs; each mode
then adds two [Q, N] x [N, p]-sized matmuls, and nothing wider than [Q, max(Q, N, p)]
is ever live (the registers of one GPU thread block hold it). The stacked form
(`chunk_forward_stacked`, the Mosaic TPU kernel's) holds the M states as one [M N, p] tile
and does each state term as one matmul of contraction M N, with [Q, M N] tiles live (VMEM).

Precision: matmuls of inputs (x, c, bd, their cotangents) run in the input dtype with
float32 accumulation (bf16 on the MXU / tensor cores for bf16 inputs); everything that
touches a state, and every decay, is float32 (f32 matmuls at HIGHEST precision; in the
stacked form, for 16-bit inputs, a matmul with a state carries 16 significant bits,
`_state_dot`, the inputs' own 8 being the larger error). The Mosaic
GPU kernel differs here: its WGMMA operands, states included, are in the input dtype (float32
accumulation), since TF32 WGMMA would need transposed copies of every state operand.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from neurips26_jax.jaxops import tiling

_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


class Modes(NamedTuple):
  """Rates and weights of one group as rows [1, M_pad] (float32; padded modes are 0)."""

  rates: jax.Array
  weights: jax.Array


# ----------------------------------------------------------------------------
# Small helpers that lower in Mosaic and Triton alike.
# ----------------------------------------------------------------------------

def _mm(form, a, b, low):
  """Matmul `form` (tiling.dot / dot_nt / dot_tn) with float32 accumulation: in `low`
  (the inputs' dtype) when that is not float32, else float32 at HIGHEST precision."""
  if low != _F32:
    return form(a.astype(low), b.astype(low))
  return form(a.astype(_F32), b.astype(_F32), precision=_HIGHEST)


def _f32(form, a, b):
  return form(a.astype(_F32), b.astype(_F32), precision=_HIGHEST)


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


def _rowsum(a):
  return jnp.sum(a, axis=1, keepdims=True)


def _entry(row, j):
  """row[0, j] as [1, 1]."""
  return jnp.sum(jnp.where(_iota(row.shape, 1) == j, row, 0.0), axis=1, keepdims=True)


def _at(j, value, width):
  """A [1, width] row holding `value` ([1, 1]) at column j, zeros elsewhere."""
  return jnp.where(_iota((1, width), 1) == j, value, 0.0)


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
  t_row: jax.Array   # [1, Q] t as a row


class _Mode(NamedTuple):
  """Decays of mode j in one chunk."""

  rate: jax.Array    # [1, 1]
  weight: jax.Array  # [1, 1]
  grow: jax.Array    # [Q, 1] e^{-r t}: from the chunk start to token t
  out_of: jax.Array  # [Q, 1] e^{-r (t_Q - t)}: from token t to the chunk end
  keep: jax.Array    # [1, 1] e^{-r t_Q}


def _prepare(t, modes: Modes, num_modes: int, t_row=None) -> _Chunk:
  """t [Q, 1]; t_row: t as a row [1, Q] where the caller has it."""
  q = t.shape[0]
  causal = _iota((q, q), 0) >= _iota((q, q), 1)
  t_row = _to_row(t) if t_row is None else t_row
  delta = jnp.where(causal, t - t_row, 0.0)
  lmix = jnp.zeros_like(delta)
  for j in range(num_modes):
    lmix += _entry(modes.weights, j) * jnp.exp(-_entry(modes.rates, j) * delta)
  return _Chunk(causal, delta, _last(t), jnp.where(causal, lmix, 0.0), t_row)


def _mode(t, t_end, modes: Modes, j) -> _Mode:
  rate, weight = _entry(modes.rates, j), _entry(modes.weights, j)
  return _Mode(rate, weight, jnp.exp(-rate * t), jnp.exp(-rate * (t_end - t)),
               jnp.exp(-rate * t_end))


# ----------------------------------------------------------------------------
# The in-chunk terms, shared by both forms.
# ----------------------------------------------------------------------------

def _intra_forward(x, cb, k: _Chunk, low):
  """(cb * Lmix) x with cb = c bd^T [Q, Q] (made from the caller's layout of bd): the tokens
  of this chunk, [Q, p] float32."""
  return _mm(tiling.dot, cb * k.lmix, x, low)


def _intra_backward(x, cb, k: _Chunk, dy, low):
  """Cotangents of the in-chunk term given cb = c bd^T: (dscores, dcb, dx), dscores the
  cotangent of cb * Lmix and dcb that of cb (the caller takes dc and dbd from it, each in
  its own layout)."""
  dscores = _mm(tiling.dot_nt, dy, x, low)
  dcb = dscores * k.lmix
  return dscores, dcb, _mm(tiling.dot_tn, cb * k.lmix, dy, low)


def _lmix_backward(k: _Chunk, modes: Modes, num_modes: int, dscores, cb):
  """Through Lmix = sum_j w_j exp(-r_j delta) on the causal part: (dmodes, the cotangent of
  t [Q, 1] through delta = t_t - t_tau)."""
  m_pad = modes.rates.shape[1]
  dlmix = jnp.where(k.causal, dscores * cb, 0.0)
  ddelta = jnp.zeros_like(k.delta)
  drates = dweights = jnp.zeros((1, m_pad), _F32)
  for j in range(num_modes):
    rate, weight = _entry(modes.rates, j), _entry(modes.weights, j)
    g = dlmix * jnp.exp(-rate * k.delta)
    dweights += _at(j, _total(g), m_pad)
    drates -= _at(j, weight * _total(g * k.delta), m_pad)
    ddelta -= (weight * rate) * g
  dt = _rowsum(ddelta) - _to_col(jnp.sum(ddelta, axis=0, keepdims=True))
  return Modes(drates, dweights), dt


def _end_column(t, dt_end):
  """dt_end ([1, 1], the cotangent of t_Q) placed at the chunk's last row of a [Q, 1]."""
  return jnp.where(_iota(t.shape, 0) == t.shape[0] - 1, dt_end, 0.0)


# ----------------------------------------------------------------------------
# Forward and backward of one chunk, a mode at a time.
# ----------------------------------------------------------------------------

def chunk_forward(x, bd, c, t, modes: Modes, states: Sequence[jax.Array]):
  """One chunk: returns (y [Q, p] float32, the M states at the chunk end, float32).

  x, c in the input dtype; bd, t float32; states: M arrays [N, p] float32.
  """
  low = x.dtype
  k = _prepare(t, modes, len(states))
  y = _intra_forward(x, _mm(tiling.dot_nt, c, bd, low), k, low)
  new_states = []
  for j, state in enumerate(states):
    mode = _mode(t, k.t_end, modes, j)
    y += _f32(tiling.dot, c * (mode.weight * mode.grow), state)
    new_states.append(mode.keep * state + _mm(tiling.dot_tn, bd * mode.out_of, x, low))
  return y, new_states


def chunk_backward(x, bd, c, t, modes: Modes, states, dy, dstates):
  """Reverse of `chunk_forward` given the M states at the chunk start.

  Args:
    dy: [Q, p] cotangent of y; dstates: M arrays [N, p], cotangents of the end states.

  Returns:
    (dx, dbd, dc, dt, dmodes, dstates at the chunk start), all float32; dt is the
    cotangent of t (the in-chunk cumulative dt), dmodes a `Modes` of cotangent rows.
    With the columns split into blocks, every result but dx and dstates is this block's
    share and the blocks' shares add up.
  """
  low, m_pad = x.dtype, modes.rates.shape[1]
  k = _prepare(t, modes, len(states))
  cb = _mm(tiling.dot_nt, c, bd, low)                                       # [Q, Q]
  dscores, dcb, dx = _intra_backward(x, cb, k, dy, low)
  dc, dbd = _mm(tiling.dot, dcb, bd, low), _mm(tiling.dot_tn, dcb, c, low)
  drates = dweights = jnp.zeros((1, m_pad), _F32)
  dt_col = jnp.zeros_like(t)
  dt_end = jnp.zeros((1, 1), _F32)
  dstates_start = []
  for j, (state, dstate) in enumerate(zip(states, dstates)):
    mode = _mode(t, k.t_end, modes, j)
    into = mode.weight * mode.grow                        # [Q, 1]
    # y += (c * into) S_j
    d_c_in = _f32(tiling.dot_nt, dy, state)               # [Q, N]
    dc += d_c_in * into
    d_into = _rowsum(d_c_in * c)                          # [Q, 1]
    dstates_start.append(mode.keep * dstate + _f32(tiling.dot_tn, c * into, dy))
    # S_j' = keep S_j + (bd * out_of)^T x
    d_bd_out = _f32(tiling.dot_nt, x, dstate)             # [Q, N]
    dbd += d_bd_out * mode.out_of
    dx += _f32(tiling.dot, bd * mode.out_of, dstate)
    # Through the decays: g = (cotangent of a decay) * (that decay).
    g_in = d_into * into
    g_out = _rowsum(d_bd_out * bd) * mode.out_of
    g_keep = _total(state * dstate) * mode.keep
    dweights += _at(j, _total(d_into * mode.grow), m_pad)
    drates -= _at(j, _total(g_in * t + g_out * (k.t_end - t)) + g_keep * k.t_end, m_pad)
    dt_col += (g_out - g_in) * mode.rate
    dt_end -= (_total(g_out) + g_keep) * mode.rate
  dlmix_modes, dt_lmix = _lmix_backward(k, modes, len(states), dscores, cb)
  dmodes = Modes(drates + dlmix_modes.rates, dweights + dlmix_modes.weights)
  return dx, dbd, dc, dt_col + dt_lmix + _end_column(t, dt_end), dmodes, dstates_start


# ----------------------------------------------------------------------------
# The same chunk with the modes' states stacked: one [M N, p] tile, every mode in each
# matmul (TPU: a mode at a time is M matmuls of contraction N = 16, a sliver of the MXU).
# ----------------------------------------------------------------------------

def _bf16_parts(v, terms: int):
  """v as a sum of bf16 terms: itself if bf16, else `terms` of them, 8 significant bits
  each (three hold float32's 24 exactly)."""
  if v.dtype == jnp.bfloat16:
    return [v]
  parts, rest = [], v.astype(_F32)
  for _ in range(terms):
    parts.append(rest.astype(jnp.bfloat16))
    rest = rest - parts[-1].astype(_F32)
  return parts


def _split_dot(form, a, b, terms: int):
  """form(a, b) where one operand is bf16: the other split into `terms` bf16 parts, so
  every product is exact."""
  if a.dtype == jnp.bfloat16:
    return sum(form(a, part) for part in _bf16_parts(b, terms))
  return sum(form(part, b) for part in _bf16_parts(a, terms))


def _dot01(form, a, b, low):
  """form(a, b) where one operand is a bf16 matrix of 0s and 1s. For float32 inputs (`low`)
  the other in three parts, float32's accuracy (a HIGHEST float32 matmul takes six passes);
  for 16-bit inputs two, 16 significant bits, beside which the inputs' own rounding
  dominates."""
  return _split_dot(form, a, b, 3 if low == _F32 else 2)


def _state_dot(form, a, b, low):
  """form(a, b) where one operand is a state or its cotangent (float32). For float32 inputs
  (`low`) a HIGHEST float32 matmul (six passes). For 16-bit inputs 16 significant bits, as
  `_dot01`'s: each float32 operand in two bf16 parts (a bf16 one is its own part), the
  product of the two low parts left out: two or three passes."""
  if low == _F32:
    return _f32(form, a, b)
  return sum(form(p, q) for i, p in enumerate(_bf16_parts(a, 2))
             for j, q in enumerate(_bf16_parts(b, 2)) if i + j < 2)


class _Stacked(NamedTuple):
  """The stacked layout's constants (row or column k = j N + n is mode j's n).

  rep [N, K] and rep_t [K, N] (its transpose) are 1 where k's n is n: c @ rep repeats c
  once per mode; of [K, M_pad] is 1 where row k belongs to mode j: a [Q, K] @ of sums each
  mode's N columns (all three bf16, exact). rate, weight [1, K] and rate_col, weight_col
  [K, 1]: each mode's rate and weight repeated N times; padded modes (j >= num_modes) get
  live_col = 0.
  """

  rep: jax.Array
  rep_t: jax.Array
  of: jax.Array
  rate: jax.Array
  weight: jax.Array
  rate_col: jax.Array
  weight_col: jax.Array
  live_col: jax.Array


def _stacked(modes: Modes, n: int, num_modes: int) -> _Stacked:
  if n & (n - 1):
    raise ValueError(f"frac_chunk: the stacked form needs N a power of two, got N = {n}")
  m_pad = modes.rates.shape[1]
  k_rows = m_pad * n
  one = lambda cond: jnp.where(cond, 1.0, 0.0).astype(jnp.bfloat16)
  same_n = lambda k, n_: (k & (n - 1)) == n_
  in_mode = lambda k, j: (k >= j * n) & (k < j * n + n)
  of_km = in_mode(_iota((k_rows, m_pad), 0), _iota((k_rows, m_pad), 1))
  of_mk = in_mode(_iota((m_pad, k_rows), 1), _iota((m_pad, k_rows), 0))
  per_k = lambda row: jnp.sum(jnp.where(of_mk, _to_col(row), 0.0), axis=0, keepdims=True)
  per_k_col = lambda row: jnp.sum(jnp.where(of_km, row, 0.0), axis=1, keepdims=True)
  return _Stacked(one(same_n(_iota((n, k_rows), 1), _iota((n, k_rows), 0))),
                  one(same_n(_iota((k_rows, n), 0), _iota((k_rows, n), 1))),
                  one(of_km), per_k(modes.rates), per_k(modes.weights),
                  per_k_col(modes.rates), per_k_col(modes.weights),
                  jnp.where(_iota((k_rows, 1), 0) < num_modes * n, 1.0, 0.0))


def chunk_forward_stacked(x, bd_t, c, t_row, modes: Modes, state, *, num_modes: int):
  """`chunk_forward` with the states stacked: state [K, p] float32, K = M_pad N, mode j in
  rows j N .. j N + N - 1 (N a power of two; the modes past num_modes are padding and their
  rows stay zero), dt b transposed, bd_t [N, Q], and t as a row t_row [1, Q]: the Mosaic
  kernel reads both lane-dense (token-major, a [Q, 16] tile fills a 128-lane row per token,
  in HBM too). Returns (y [Q, p], the end state [K, p]), float32.

    y  = ((c bd^T) * Lmix) x + ((c rep) * into) S,    into[t, k] = w_k e^{-r_k t_t}
    S' = keep * S + (rep^T bd^T * out_t) x,           out_t[k, t] = e^{-r_k (t_Q - t_t)}

  The update's [K, Q] factor is built transposed, so no matmul contracts over sublanes.
  """
  low = x.dtype
  t = _to_col(t_row)
  k = _prepare(t, modes, num_modes, t_row)
  st = _stacked(modes, c.shape[1], num_modes)
  y = _intra_forward(x, _mm(tiling.dot, c, bd_t, low), k, low)
  into = st.weight * jnp.exp(-st.rate * t)                                   # [Q, K]
  y += _state_dot(tiling.dot, _dot01(tiling.dot, c, st.rep, low) * into, state, low)
  out_t = st.live_col * jnp.exp(-st.rate_col * (k.t_end - k.t_row))          # [K, Q]
  keep = jnp.exp(-st.rate_col * k.t_end)                                     # [K, 1]
  update = _dot01(tiling.dot, st.rep_t, bd_t, low) * out_t                   # [K, Q]
  return y, keep * state + _mm(tiling.dot, update, x, low)


def chunk_backward_stacked(x, bd, bd_t, c, c_t, t_row, modes: Modes, state, dy, dstate, *,
                           num_modes: int):
  """Reverse of `chunk_forward_stacked` given the stacked start state [K, p] and the end
  state's cotangent dstate [K, p], dt b and c in both layouts ([Q, N] and transposed [N, Q]):
  (dx, dbd_t, dc_t, dt, dmodes, dstate at the chunk start) as `chunk_backward`'s, the
  cotangents of dt b and c transposed [N, Q], dt's as a row [1, Q] (all three lane-dense)
  and the state's stacked."""
  low = x.dtype
  t = _to_col(t_row)
  k = _prepare(t, modes, num_modes, t_row)
  st = _stacked(modes, c.shape[1], num_modes)
  cb = _mm(tiling.dot, c, bd_t, low)                                         # [Q, Q]
  dscores, dcb, dx = _intra_backward(x, cb, k, dy, low)
  dc_t = _mm(tiling.dot_nt, bd_t, dcb, low)                                  # [N, Q]
  dbd_t = _mm(tiling.dot, c_t, dcb, low)                                     # [N, Q]
  into = st.weight * jnp.exp(-st.rate * t)                                   # [Q, K]
  out_of = jnp.exp(-st.rate * (k.t_end - t))                                 # [Q, K]
  # y += (c_rep * into) S
  c_rep = _dot01(tiling.dot, c, st.rep, low)                                 # [Q, K]
  d_c_in = _state_dot(tiling.dot_nt, dy, state, low)                         # [Q, K]
  dc_t += _dot01(tiling.dot_nt, st.rep, d_c_in * into, low)
  d_into = _dot01(tiling.dot, d_c_in * c_rep, st.of, low)                    # [Q, M_pad]
  into_t = st.weight_col * jnp.exp(-st.rate_col * k.t_row)                   # [K, Q]
  keep_col = jnp.exp(-st.rate_col * k.t_end)
  dstate_start = keep_col * dstate + _state_dot(
      tiling.dot, _dot01(tiling.dot_nt, st.rep_t, c, low) * into_t, dy, low)
  # S' = keep S + (bd_rep * out_of)^T x
  bd_rep = _dot01(tiling.dot, bd, st.rep, low)
  d_bd_out = _state_dot(tiling.dot_nt, x, dstate, low)                       # [Q, K]
  dbd_t += _dot01(tiling.dot_nt, st.rep, d_bd_out * out_of, low)
  dx += _state_dot(tiling.dot, bd_rep * out_of, dstate, low)
  # Through the decays, per mode ([Q, M_pad] columns, [1, M_pad] rows).
  rates = modes.rates
  grow, out_m = jnp.exp(-rates * t), jnp.exp(-rates * (k.t_end - t))
  keep = jnp.exp(-rates * k.t_end)
  g_in = d_into * (modes.weights * grow)
  g_out = _dot01(tiling.dot, d_bd_out * bd_rep, st.of, low) * out_m
  colsum = lambda a: jnp.sum(a, axis=0, keepdims=True)
  g_keep = colsum(jnp.where(st.of > 0, _rowsum(state * dstate), 0.0)) * keep  # [1, M_pad]
  dweights = colsum(d_into * grow)
  drates = -(colsum(g_in * t + g_out * (k.t_end - t)) + g_keep * k.t_end)
  dt_col = _rowsum((g_out - g_in) * rates)
  dt_end = -_rowsum((colsum(g_out) + g_keep) * rates)
  dlmix_modes, dt_lmix = _lmix_backward(k, modes, num_modes, dscores, cb)
  dmodes = Modes(drates + dlmix_modes.rates, dweights + dlmix_modes.weights)
  dt = _to_row(dt_col + dt_lmix + _end_column(t, dt_end))
  return dx, dbd_t, dc_t, dt, dmodes, dstate_start


# ----------------------------------------------------------------------------
# The tile plan: [Bt, L, H, X] <-> per-group tiles [G, Lp, X'], G = Bt * H.
# ----------------------------------------------------------------------------

def _by_triangle(a, lower: bool):
  """a [..., Q] float32 times the 0/1 triangle [Q, Q] (upper: running sums; lower: sums of
  what follows), a in three bf16 parts: exact products, float32 sums."""
  q = a.shape[-1]
  rows, cols = _iota((q, q), 0), _iota((q, q), 1)
  triangle = jnp.where(rows >= cols if lower else rows <= cols, 1.0, 0.0).astype(jnp.bfloat16)
  return _split_dot(functools.partial(jnp.matmul, preferred_element_type=_F32), a, triangle, 3)


@jax.custom_vjp
def running_sum(a):
  """jnp.cumsum(a, axis=-1) of float32 a [..., Q] as a matmul with a 0/1 triangle, and its
  VJP as one with the other: on TPU XLA's cumsum is a reduce-window of Q adds per element
  and its transpose another (29K cycles in a 125M FRAC block's backward at 4k tokens; the
  matmuls ~1K)."""
  return _by_triangle(a, lower=False)


running_sum.defvjp(lambda a: (running_sum(a), None),
                   lambda _, g: (_by_triangle(g.astype(_F32), lower=True),))

@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Chunk size and padded extents: L -> length (a multiple of chunk), P -> p (a multiple
  of p_block), N -> n, and M modes in m_pad, a multiple of m_align and of m_block (modes
  are independent given the inputs, so a kernel may give each program a block of them;
  any power of two <= m_align divides m_pad).

  Padding is inert: padded tokens have dt = 0 and x = b = c = 0, padded modes have
  rate = weight = 0 (their states are never read) and padded rows of b, c and the state
  are zero.
  """

  chunk: int
  length: int
  p: int
  p_block: int
  n: int
  m: int
  m_align: int
  m_pad: int
  m_block: int

  @classmethod
  def make(cls, x, b, rates, *, chunk: int, mode_align: int | None = None,
           pow2: bool = False) -> "TilePlan":
    """pow2: chunk and N >= 16, P and the mode alignment rounded to powers of two
    (Triton's rule; Mosaic accepts it). One block of all P columns and all M modes; a
    kernel splits them with `dataclasses.replace(plan, p_block=..., m_block=...)`."""
    _, length, _, p = x.shape
    n, m = b.shape[3], rates.shape[1]
    m_align = min(mode_align or m, m)
    if pow2:
      up = tiling.next_pow2
      chunk, n, p = min(up(chunk), up(length, 16)), up(n), up(p)
      m_align = 1 << (m_align.bit_length() - 1)        # the largest power of two <= m_align
    else:
      chunk = min(chunk, length)
    m_pad = tiling.round_up(m, m_align)
    return cls(chunk, tiling.round_up(length, chunk), p, p, n, m, m_align, m_pad, m_pad)

  @property
  def num_chunks(self) -> int:
    return self.length // self.chunk

  @property
  def num_p_blocks(self) -> int:
    return self.p // self.p_block

  @property
  def num_m_blocks(self) -> int:
    return self.m_pad // self.m_block

  def _groups(self, a, width):
    """[Bt, L, H, X] -> [G, length, width], zero-padded."""
    batch, length, heads, x_width = a.shape
    a = jnp.moveaxis(a, 2, 1).reshape(batch * heads, length, x_width)
    return jnp.pad(a, ((0, 0), (0, self.length - length), (0, width - x_width)))

  def tiles(self, x, dt, b, c, rates, weights, state):
    """Inputs in tile layout: (x, bd, c, t, modes, state) with bd, t float32,
    modes rows [G, 1, m_pad], state [G, m_pad * n, p] float32."""
    batch = x.shape[0]
    dt = self._groups(dt.astype(_F32)[..., None], 1)
    t = running_sum(dt.reshape(-1, self.num_chunks, self.chunk)).reshape(dt.shape)
    bd = self._groups(b.astype(_F32), self.n) * dt

    def per_group(v):  # [H, M] -> [G, 1, m_pad]
      v = jnp.pad(v.astype(_F32), ((0, 0), (0, self.m_pad - v.shape[1])))
      return jnp.broadcast_to(v, (batch,) + v.shape).reshape(-1, 1, self.m_pad)

    m, n, p = state.shape[2:]
    state = jnp.pad(state.astype(_F32),
                    ((0, 0),) * 2 + ((0, self.m_pad - m), (0, self.n - n), (0, self.p - p)))
    return (self._groups(x, self.p), bd, self._groups(c, self.n), t,
            Modes(per_group(rates), per_group(weights)),
            state.reshape(-1, self.m_pad * self.n, self.p))

  def untile(self, y, state, x, b, rates):
    """(y [G, length, p], state [G, m_pad * n, p]) -> (y [Bt, L, H, P], state [Bt, H, M, N, P])."""
    batch, length, heads, p = x.shape
    y = y[:, :length, :p].reshape(batch, heads, length, p)
    state = state.reshape(batch, heads, self.m_pad, self.n, self.p)
    return jnp.moveaxis(y, 1, 2).astype(x.dtype), state[:, :, :self.m, :b.shape[3], :p]
