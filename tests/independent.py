"""Independent float64 references, written from DESIGN.md alone.

Nothing here imports `jaxops`, `pallas_kernels` or `models`, and nothing here was written
from their code: each function is the math of DESIGN.md sections 2-4 written out as
literally as it reads, in float64 numpy, with plain Python loops where the math is a loop
(over query tokens, heads, experts, modes, time steps). Sizes in the tests are tiny, so
speed does not matter; readability does.

Conventions taken from the public docstrings (the one thing DESIGN.md leaves open):
a RoPE of width 2m rotates the pairs (x_k, x_{m+k}), k = 0..m-1 (`jaxops.rope` module
docstring), and axial RoPE gives the z, y, x parts the head-dim slices [0, D/3),
[D/3, 2D/3), [2D/3, D) in that order.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# ----------------------------------------------------------------------------------------
# RoPE (DESIGN.md section 3): part a rotates pairs by p_a s_a theta^(-k/m_a), m_a = D/6.
# ----------------------------------------------------------------------------------------


def rope_matrix_1d(position: float, width: int, theta: float) -> np.ndarray:
  """R(p), width x width: rotates the pair (x_k, x_{m+k}) by a_k = p theta^(-k/m), m = width/2."""
  assert width % 2 == 0, width
  m = width // 2
  rot = np.zeros((width, width))
  for k in range(m):
    angle = float(position) * float(theta) ** (-k / m)
    cos, sin = math.cos(angle), math.sin(angle)
    # [x_k; x_{m+k}] -> [x_k cos - x_{m+k} sin; x_k sin + x_{m+k} cos]
    rot[k, k], rot[k, m + k] = cos, -sin
    rot[m + k, k], rot[m + k, m + k] = sin, cos
  return rot


@functools.lru_cache(maxsize=None)
def _rope_matrix_3d_cached(offset: tuple, d: int, theta: float, spacing: tuple) -> np.ndarray:
  assert d % 6 == 0, d
  w = d // 3  # each axis gets width 2 m_a = D/3
  rot = np.zeros((d, d))
  for a in range(3):  # a = z, y, x
    rot[a * w:(a + 1) * w, a * w:(a + 1) * w] = rope_matrix_1d(offset[a] * spacing[a], w, theta)
  rot.setflags(write=False)
  return rot


def rope_matrix_3d(position, d: int, theta: float = 10000.0, spacing=(1.0, 1.0, 1.0)):
  """Axial R(p), D x D block diagonal: block a is the 1D RoPE of width D/3 at p_a * s_a."""
  return _rope_matrix_3d_cached(tuple(int(p) for p in position), int(d), float(theta),
                                tuple(float(s) for s in spacing))


def axial_rope_3d(x, coords, *, theta=10000.0, spacing=(1.0, 1.0, 1.0)):
  """x [..., N, H, D], coords int [..., N, 3] -> R(p_i) x_i per token, float64."""
  x = np.asarray(x, np.float64)
  coords = np.asarray(coords)
  out = np.empty_like(x)
  d = x.shape[-1]
  for idx in np.ndindex(*x.shape[:-2]):  # every token
    out[idx] = x[idx] @ rope_matrix_3d(coords[idx], d, theta, spacing).T
  return out


def rope_1d(x, positions, *, theta=10000.0):
  """x [..., N, H, D], positions [..., N] -> R(p_i) x_i with the 1D RoPE of width D."""
  x = np.asarray(x, np.float64)
  positions = np.asarray(positions, np.float64)
  out = np.empty_like(x)
  for idx in np.ndindex(*x.shape[:-2]):
    out[idx] = x[idx] @ rope_matrix_1d(positions[idx], x.shape[-1], theta).T
  return out


# ----------------------------------------------------------------------------------------
# Pack3D (DESIGN.md section 3): a loop over query tokens.
# ----------------------------------------------------------------------------------------


def pack3d_attention(q, k, v, coords, field_ids, *, block_shape=(4, 4, 4), radius_blocks=1,
                     block_bias=True, rope=None, far_offset=None):
  """Pack3D attention, one query token at a time, float64.

  rope=None: q, k are already rotated (the ops' contract). rope=(theta, spacing): q, k are
  NOT rotated, and every logit is formed from the relative rotation R(p_j - p_i):
    near key j:  s_ij = q_i^T R(p_j - p_i) k_j / sqrt(D)
    far cube b:  kbar_b(i) = mean_{j in b} R(p_j - p_i) k_j  (R applied per token, then averaged)
                 s_ib = q_i . kbar_b(i) / sqrt(D) + log(n_b) + beta_h
  which is (R(p_i) q_i) . (R(p_j) k_j) and (R(p_i) q_i) . mean_j R(p_j) k_j written relative.
  far_offset: beta [H], the per-head offset on every far logit (None: beta = 0).
  q, k, v [B, N, H, D]; coords int [B, N, 3]; field_ids int [B, N]. Returns o [B, N, H, D].
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  coords = np.asarray(coords).astype(np.int64)
  field_ids = np.asarray(field_ids)
  batch, n, heads, d = q.shape
  block = np.asarray(block_shape, np.int64)
  out = np.zeros_like(v)
  for bi in range(batch):
    cube = coords[bi] // block  # c(i) = floor(p_i / block_shape), coords >= 0
    for i in range(n):
      same_field = [j for j in range(n) if field_ids[bi, j] == field_ids[bi, i]]
      if rope is None:
        rel_k = {j: k[bi, j] for j in same_field}
      else:
        theta, spacing = rope
        rel_k = {j: k[bi, j] @ rope_matrix_3d(coords[bi, j] - coords[bi, i], d, theta,
                                              spacing).T
                 for j in same_field}
      logits, values = [], []  # one softmax over near tokens and far cubes
      far_cubes: dict[tuple, list[int]] = {}
      for j in same_field:
        dist = int(np.max(np.abs(cube[j] - cube[i])))
        if dist <= radius_blocks:  # j in Loc(i)
          logits.append(np.einsum("hd,hd->h", q[bi, i], rel_k[j]) / math.sqrt(d))
          values.append(v[bi, j])
        else:  # j's cube is in Far(i)
          far_cubes.setdefault(tuple(cube[j]), []).append(j)
      for members in far_cubes.values():
        n_b = len(members)
        kbar = sum(rel_k[j] for j in members) / n_b
        vbar = sum(v[bi, j] for j in members) / n_b
        logit = np.einsum("hd,hd->h", q[bi, i], kbar) / math.sqrt(d)
        if block_bias:
          logit = logit + math.log(n_b)
        if far_offset is not None:
          logit = logit + np.asarray(far_offset, np.float64)  # beta_h for each head h
        logits.append(logit)
        values.append(vbar)
      out[bi, i] = softmax_mix(logits, values)
  return out


def softmax_mix(logits, values):
  """One query's output: logits, a list of [H] per key, values a list of [H, D] per key ->
  sum over keys of softmax(logits)_key * value_key, [H, D]."""
  logits = np.stack(logits)  # [keys, H]
  weights = np.exp(logits - logits.max(axis=0))
  weights /= weights.sum(axis=0)
  return np.einsum("jh,jhd->hd", weights, np.stack(values))


def count_cubes(coords, field_ids, block_shape) -> int:
  """Most non-empty cubes (over all fields) in one batch entry."""
  coords, field_ids = np.asarray(coords), np.asarray(field_ids)
  block = np.asarray(block_shape)
  return max(len({(int(f),) + tuple(int(c) for c in p // block)
                  for p, f in zip(coords[bi], field_ids[bi], strict=True)})
             for bi in range(coords.shape[0]))


def field_attention(q, k, v, coords, field_ids, *, rope):
  """Full softmax attention within each field, relative RoPE, no cubes (float64)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  coords = np.asarray(coords).astype(np.int64)
  batch, n, _, d = q.shape
  theta, spacing = rope
  out = np.zeros_like(v)
  for bi in range(batch):
    for i in range(n):
      js = [j for j in range(n) if field_ids[bi, j] == field_ids[bi, i]]
      logits = np.stack([np.einsum(
          "hd,hd->h", q[bi, i],
          k[bi, j] @ rope_matrix_3d(coords[bi, j] - coords[bi, i], d, theta, spacing).T)
          for j in js]) / math.sqrt(d)
      weights = np.exp(logits - logits.max(axis=0))
      weights /= weights.sum(axis=0)
      out[bi, i] = np.einsum("jh,jhd->hd", weights, v[bi, js])
  return out


# ----------------------------------------------------------------------------------------
# FRAC (DESIGN.md section 4).
# ----------------------------------------------------------------------------------------

S_MIN_TIMES_CONTEXT = 0.03  # s in [0.03 / T, 4]
S_MAX = 4.0


def soe_modes(alpha: float, num_modes: int, context: int):
  """Tail mode first, then s_j = s_min e^(j h), j = 0..M-2, log-spaced over [0.03/T, 4].

  w_j = h exp(a ln s_j - s_j - lnGamma(a)); tail weight b^a / Gamma(a+1), rate b a/(a+1),
  b = s_min e^(-h/2). Returns (rates, weights), float64 [M].
  """
  a = float(alpha)
  grid = num_modes - 1
  s_min, s_max = S_MIN_TIMES_CONTEXT / context, S_MAX
  h = math.log(s_max / s_min) / (grid - 1)
  rates = [s_min * math.exp(j * h) for j in range(grid)]
  weights = [h * math.exp(a * math.log(s) - s - math.lgamma(a)) for s in rates]
  b = s_min * math.exp(-h / 2)
  tail_rate = b * a / (a + 1)
  tail_weight = b ** a / math.gamma(a + 1)
  return np.array([tail_rate] + rates), np.array([tail_weight] + weights)


def default_num_modes(context: int) -> int:
  """Grid step h <= 1 over [0.03/T, 4]: G - 1 >= ln(4T/0.03) grid steps, plus the tail mode."""
  return math.ceil(math.log(S_MAX * context / S_MIN_TIMES_CONTEXT)) + 2


def sum_of_exponentials(rates, weights, u):
  """sum_j w_j exp(-r_j u), float64, u any shape."""
  u = np.asarray(u, np.float64)[..., None]
  return np.sum(np.asarray(weights, np.float64) * np.exp(-np.asarray(rates, np.float64) * u),
                axis=-1)


def frac_scan(x, dt, b, c, rates, weights, initial_state=None):
  """The per-mode recurrence, a loop over tokens t and modes j, float64.

    S^j_t = exp(-r_j dt_t) S^j_{t-1} + dt_t B_t x_t^T ;   y_t = sum_j w_j C_t^T S^j_t
  x [Bt, L, H, P], dt [Bt, L, H], b, c [Bt, L, H, N], rates, weights [H, M],
  initial_state [Bt, H, M, N, P]. Returns (y [Bt, L, H, P], state [Bt, H, M, N, P]).
  """
  x, dt, b, c, rates, weights = (np.asarray(a, np.float64)
                                 for a in (x, dt, b, c, rates, weights))
  bt, length, heads, p = x.shape
  n, m = b.shape[-1], rates.shape[-1]
  state = (np.zeros((bt, heads, m, n, p)) if initial_state is None
           else np.array(initial_state, np.float64))
  y = np.zeros((bt, length, heads, p))
  for t in range(length):
    for j in range(m):
      decay = np.exp(-rates[:, j] * dt[:, t, :])  # [Bt, H]
      write = dt[:, t, :, None, None] * b[:, t, :, :, None] * x[:, t, :, None, :]  # B x^T
      state[:, :, j] = decay[:, :, None, None] * state[:, :, j] + write
      y[:, t] += weights[:, j][None, :, None] * np.einsum("bhn,bhnp->bhp", c[:, t],
                                                          state[:, :, j])
  return y, state


def memory_convolution(x, dt, b, c, kernel):
  """y_t = sum_{tau <= t} K(T_t - T_tau) (C_t . B_tau) dt_tau x_tau, T = cumulative dt.

  `kernel(u)` is the memory kernel of one head (vectorized over u); zero initial state.
  x [Bt, L, H, P] etc.; kernel is a list of H callables. Float64.
  """
  x, dt, b, c = (np.asarray(a, np.float64) for a in (x, dt, b, c))
  bt, length, heads, p = x.shape
  warped = np.cumsum(dt, axis=1)
  y = np.zeros((bt, length, heads, p))
  for bi in range(bt):
    for h in range(heads):
      for t in range(length):
        for tau in range(t + 1):
          weight = kernel[h](warped[bi, t, h] - warped[bi, tau, h]) * dt[bi, tau, h]
          y[bi, t, h] += weight * np.dot(c[bi, t, h], b[bi, tau, h]) * x[bi, tau, h]
  return y


# ----------------------------------------------------------------------------------------
# FlashFFN (DESIGN.md section 2).
# ----------------------------------------------------------------------------------------


def silu(x):
  return x / (1.0 + np.exp(-x))


def sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def mhffn(q, r, k, u, v):
  """A loop over heads h and experts e of small MLPs, float64.

    A_{h,e} = silu(q_h K_{h,e}^T) * (q_h U_{h,e}^T) ;  s_h = sum_e r_{h,e} (A_{h,e} V_{h,e})
  q [B, L, H, d_h], r [B, L, H, E], k, u, v [H, E, d_e, d_h] -> [B, L, H, d_h].
  """
  q, r, k, u, v = (np.asarray(a, np.float64) for a in (q, r, k, u, v))
  heads, experts = k.shape[:2]
  out = np.zeros_like(q)
  for h in range(heads):
    q_h = q[:, :, h, :]  # [B, L, d_h]
    for e in range(experts):
      a = silu(q_h @ k[h, e].T) * (q_h @ u[h, e].T)  # [B, L, d_e]
      out[:, :, h, :] += r[:, :, h, e, None] * (a @ v[h, e])
  return out


def flashffn_layer(x, params, *, num_heads, head_norm, eps=1e-6):
  """DESIGN.md section 2 steps 1-5 from the layer's parameters, float64.

  params: w_in [d, d], w_out [d, d], router [H, d_h, E], k, u, v [H, E, d_e, d_h] and, with
  head_norm, norm_gain [H, d_h]. x [B, L, d] -> [B, L, d].
  """
  p = {name: np.asarray(val, np.float64) for name, val in params.items()}
  x = np.asarray(x, np.float64)
  batch, length, d = x.shape
  d_h = d // num_heads
  q = (x @ p["w_in"]).reshape(batch, length, num_heads, d_h)  # step 1
  if head_norm:  # step 2: per-head RMSNorm with a learnable gain
    rms = np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + eps)
    q = q / rms * p["norm_gain"]
  r = np.zeros((batch, length, num_heads, p["router"].shape[-1]))
  for h in range(num_heads):  # step 3: dense sigmoid router, normalized per head
    gates = sigmoid(q[:, :, h, :] @ p["router"][h])
    r[:, :, h, :] = gates / np.maximum(gates.sum(axis=-1, keepdims=True), 1e-20)
  s = mhffn(q, r, p["k"], p["u"], p["v"])  # step 4
  return s.reshape(batch, length, d) @ p["w_out"]  # step 5


# ----------------------------------------------------------------------------------------
# Gradients without autodiff: float64 central differences of a scalar projection.
# ----------------------------------------------------------------------------------------


def directional_derivative(fn, args, index, direction, *, eps=1e-6):
  """d/de fn(args with args[index] + e * direction) at e = 0, central difference (float64).

  fn returns a float; central differences in float64 with eps ~1e-6 times the input scale
  are accurate to ~1e-9 relative for the smooth functions here.
  """
  args = [np.asarray(a, np.float64) if a is not None else None for a in args]
  plus, minus = list(args), list(args)
  plus[index] = args[index] + eps * direction
  minus[index] = args[index] - eps * direction
  return (fn(*plus) - fn(*minus)) / (2 * eps)
