"""FRAC scan on Hopper GPUs (Mosaic GPU, jax >= 0.11.2) in SSD's layout: every kernel is a
program per 64-token chunk (grid: group g, block pb of 64 columns of P, block mb of modes,
chunk c), and the one sequential part, the walk of the states over the chunks, is
elementwise XLA between the kernels.

WGMMA wants M = 64 rows, so a chunk is Q = 64 tokens (the token axis is M of the [Q, *]
products) and states are kept transposed, S_j^T [64, N] (P is M of a state product; N = 16
is a legal WGMMA N). With the notation of `jaxops.frac_chunk`, E_c the states at the end of
chunk c (E_{-1} the initial state) and dE_c their cotangents::

  forward   own_c,j  = x^T (bd * e^{-r_j (t_Q - t)})      [64, N]   `_own_states`
            E_c,j    = e^{-r_j t_Q} E_{c-1},j + own_c,j              `_walk` (XLA)
            y_c      = ((c bd^T) * Lmix) x + sum_j (c * w_j e^{-r_j t}) E_{c-1},j^T `_outputs`
  backward  own'_c,j = dy^T (c * w_j e^{-r_j t})          [64, N]   `_own_states`
            dE_{c-1} = e^{-r_j t_Q} dE_c + own'_c                    `_walk_back` (XLA)
            the terms inside each chunk, through cb and Lmix         `_intra`
            the terms through E_{c-1} and own_c, given E_{c-1}, dE_c `_state_grads`
            the keep decays e^{-r_j t_Q}: sum(dE_c * E_{c-1}), differentiated by JAX

So every kernel fills the GPU however few the groups (B x H x chunks programs), and no
program waits for another. The backward's in-chunk and state terms are separate kernels
because one alone would hold too many [Q, Q] and state values for the register file; their
per-token results are shares that XLA adds.

Operands. WGMMA reads B (and here A) from shared memory; values computed in registers are
written there first. Every operand is in the input dtype: products of bf16 inputs run on
the tensor cores in bf16, and so do the state terms (the walks' states and cotangents are
float32, handed to the kernels rounded to the input dtype; TF32 would need K-major copies
of every state operand). For float32 inputs the same code runs in the interpreter only: on
a real chip `dispatch` refuses float32 Mosaic GPU kernels (`dispatch.mosaic_gpu_dtype_ok`).

Shapes served: the plan's chunk must be 64 (or the whole padded sequence, one chunk, which
is padded here to 64 tokens) and N (padded to 16 or 32) at most 32; P is padded to a
multiple of 64 with inert zero columns. `unsupported` says why a plan does not fit;
`frac_scan` falls back to Triton then.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from neurips26_jax.jaxops import tiling
from neurips26_jax.jaxops.frac_chunk import Modes, TilePlan
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_module
from neurips26_jax.pallas_kernels.mosaic_gpu_common import (accumulators, interpret_params, mma,
                                                            mma_wait, product_sum, products, read,
                                                            smem_transforms, store_operands)

_F32 = jnp.float32
CHUNK = 64     # tokens per chunk: WGMMA's M
COLUMNS = 64   # columns of P per program: M of the state update


# The outputs kernel holds every mode's start states [64, N] in shared memory (16-bit): at
# most this many modes x N, 128 KiB of the 227 KiB a block may have (with its other buffers,
# 37 KiB, and `_MODES_PER_WAIT` modes' operands, up to 32 KiB).
MAX_MODES_X_N = 1024
_MODES_PER_WAIT = 8


def unsupported(plan: TilePlan) -> str | None:
  """Why the kernel cannot serve this plan (None: it can). It needs 64-token chunks (or one
  chunk holding the whole sequence), N <= 32 (the widths its registers and shared memory
  were compile-checked for) and padded modes x N <= MAX_MODES_X_N."""
  if not (plan.chunk == CHUNK or (plan.num_chunks == 1 and plan.chunk < CHUNK)):
    return (f"needs `chunk`={CHUNK} (or a sequence of at most one chunk), got chunk "
            f"{plan.chunk}")
  if plan.n > 32:
    return f"needs N <= 32 (the last dim of `b`), got {plan.n} after padding to a power of two"
  if plan.m_pad * plan.n > MAX_MODES_X_N:
    return (f"needs modes x N <= {MAX_MODES_X_N} (every mode's states in shared memory), got "
            f"{plan.m_pad} x {plan.n} after padding")
  return None


@dataclasses.dataclass(frozen=True)
class _Grid:
  """The kernel's extents: `length` tokens (a multiple of CHUNK), `p` columns (of COLUMNS),
  m_block modes per program."""

  plan: TilePlan
  m_block: int

  @property
  def length(self) -> int:
    return tiling.round_up(self.plan.length, CHUNK)

  @property
  def p(self) -> int:
    return tiling.round_up(self.plan.p, COLUMNS)

  @property
  def chunks(self) -> int:
    return self.length // CHUNK

  @property
  def m_blocks(self) -> int:
    return self.plan.m_pad // self.m_block


def _grid(plan: TilePlan, blocks, all_modes: bool) -> _Grid:
  """m_block: every mode (the kernels in which the modes meet: Lmix, or one sum over the
  modes), or (the backward's state terms) the tuned count, at most 64 / N (N >= 16, a power
  of two): its operands scale with m_block * N."""
  assert unsupported(plan) is None, plan  # frac_scan checks it
  if all_modes:
    return _Grid(plan, plan.m_pad)
  return _Grid(plan, min(blocks.m_block, plan.m_align, max(1, 64 // plan.n)))


# ----------------------------------------------------------------------------
# Layout changes between the shared tile plan and the kernel's.
# ----------------------------------------------------------------------------

def _pad_tokens(grid: _Grid, a, mode="constant"):
  """[G, Lp, ...] -> [G, length, ...]; t pads with its last value (padded dt = 0)."""
  pad = [(0, 0)] * a.ndim
  pad[1] = (0, grid.length - a.shape[1])
  return jnp.pad(a, pad, mode=mode)


def _columns(grid: _Grid, a):
  """[G, Lp, p] -> [G, length, P64], zero-padded (dy)."""
  return jnp.pad(_pad_tokens(grid, a), ((0, 0), (0, 0), (0, grid.p - a.shape[2])))


def _columns_t(grid: _Grid, a):
  """[G, Lp, p] -> [G, P64, length]: x transposed, zero-padded."""
  return jnp.swapaxes(_columns(grid, a), 1, 2)


def _state_t(grid: _Grid, s):
  """[..., m_pad * n, p] (the shared format) -> [..., m_pad, P64, n] (states transposed)."""
  plan = grid.plan
  s = s.reshape(s.shape[:-2] + (plan.m_pad, plan.n, plan.p))
  s = jnp.swapaxes(s, -1, -2)
  return jnp.pad(s, [(0, 0)] * (s.ndim - 2) + [(0, grid.p - plan.p), (0, 0)])


def _state_shared(grid: _Grid, s):
  """Inverse of `_state_t`."""
  plan = grid.plan
  s = jnp.swapaxes(s[..., :plan.p, :], -1, -2)
  return s.reshape(s.shape[:-3] + (plan.m_pad * plan.n, plan.p))


def _inputs(grid: _Grid, x, bd, c, t):
  """Kernel inputs: x^T [G, P64, length], c and bd [G, length, n] in x's dtype, t [G, length]."""
  low = x.dtype
  return (_columns_t(grid, x), _pad_tokens(grid, c).astype(low), _pad_tokens(grid, bd).astype(low),
          _pad_tokens(grid, t[..., 0], mode="edge"))


# ----------------------------------------------------------------------------
# Per-chunk quantities in registers.
# ----------------------------------------------------------------------------

class _Decays:
  """Token positions of one chunk and the decays of its modes, from t [Q] in SMEM.

  The [Q, Q] mask and time differences are properties, made where they are used: cheap
  to recompute from two [Q] vectors, and 32 registers a thread each if kept."""

  def __init__(self, plgpu, t_s, rates_ref, weights_ref, row0):
    self.plgpu, self.rates_ref, self.weights_ref, self.row0 = plgpu, rates_ref, weights_ref, row0
    self.t = plgpu.load(t_s, layout=plgpu.Layout.WGMMA.reduce(1))       # t_t, by row
    self.t_cols = plgpu.load(t_s, layout=plgpu.Layout.WGMMA.reduce(0))  # t_tau, by column
    self.t_end = t_s[CHUNK - 1]

  @property
  def causal(self):
    """tau <= t, [Q, Q]."""
    iota = functools.partial(self.plgpu.broadcasted_iota, jnp.int32, (CHUNK, CHUNK),
                             layout=self.plgpu.Layout.WGMMA)
    return iota(0) >= iota(1)

  @property
  def delta(self):
    """t_t - t_tau on and below the diagonal, 0 above ([Q, Q]; t never decreases in a
    chunk, so the clamp is the mask)."""
    shape = (CHUNK, CHUNK)
    return jnp.maximum(_rows(self.t, shape) - _cols(self.t_cols, shape), 0.0)

  def mode(self, j):
    """(rate, weight) of the program's mode j, scalars."""
    return self.rates_ref[self.row0 + j], self.weights_ref[self.row0 + j]

  def lmix(self, m_block):
    """sum_j w_j exp(-r_j (t_t - t_tau)) on and below the diagonal, [Q, Q]."""
    total = 0.0
    for j in range(m_block):
      rate, weight = self.mode(j)
      total += weight * self.decay(rate)
    return jnp.where(self.causal, total, 0.0)

  def decay(self, rate):
    """exp(-r (t_t - t_tau)) [Q, Q] (1 above the diagonal)."""
    return jnp.exp(-rate * self.delta)

  def grow(self, rate):
    """e^{-r t} [Q] (rows): from the chunk start to token t."""
    return jnp.exp(-rate * self.t)

  def out_of(self, rate):
    """e^{-r (t_Q - t)} [Q] (rows): from token t to the chunk end."""
    return jnp.exp(-rate * (self.t_end - self.t))


def _lane_params(plgpu):
  """Lane semantics: every array's layout is set where it is made (the loads, the iotas,
  WGMMA's accumulators) and follows from there; the default warpgroup semantics' layout
  search runs out of fuel on this kernel."""
  return plgpu.CompilerParams(approx_math=False,
                              lowering_semantics=plgpu.LoweringSemantics.Lane)


def _load(plgpu, ref):
  """A [64k, *] tile from shared memory as float32 in the WGMMA layout."""
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA).astype(_F32)


def _rows(v, shape):
  """v [shape[0]] (indexed by row) broadcast along the columns."""
  return lax.broadcast_in_dim(v, shape, [0])


def _cols(v, shape):
  """v [shape[1]] (indexed by column) broadcast along the rows."""
  return lax.broadcast_in_dim(v, shape, [1])


class _Kernel:
  """What the kernels share: the plan, the operand layouts, the tile specs of one chunk and
  the launch on the grid (g, pb, mb, c)."""

  def __init__(self, plan: TilePlan, blocks, x, *, all_modes: bool = False):
    self.plgpu = plgpu = mosaic_gpu_module()
    self.plan, self.grid = plan, _grid(plan, blocks, all_modes)
    self.low, self.n, self.mb = x.dtype, plan.n, self.grid.m_block
    self.groups = x.shape[0]
    self.transforms = smem_transforms(plgpu, self.low, self.n, CHUNK, COLUMNS)

  def operand(self, shape):
    """A shared-memory WGMMA operand in the input dtype."""
    return self.plgpu.SMEM(shape, self.low, transforms=self.transforms)

  def staging(self, shape):
    """A float32 shared-memory buffer for results, swizzled so that storing WGMMA-layout
    values into it is free of bank conflicts."""
    plgpu = self.plgpu
    return plgpu.SMEM(shape, _F32, transforms=smem_transforms(plgpu, _F32, shape[-1]))

  def tile_specs(self, *names):
    """Block specs of this chunk's tiles: "xt" (x^T [64, Q]), "c", "bd" ([Q, N]), "t" ([Q]),
    "dy" ([Q, 64]) and "states" (the mode block's S^T [m_block, 64, N]), operands swizzled."""
    q, w, n = CHUNK, COLUMNS, self.n
    chunk, pb, mb = lax.axis_index("c"), lax.axis_index("pb"), lax.axis_index("mb")
    blocks = {"xt": ((w, q), lambda i: (pb, chunk + i)),
              "c": ((q, n), lambda i: (chunk + i, 0)),
              "bd": ((q, n), lambda i: (chunk + i, 0)),
              "dy": ((q, w), lambda i: (chunk + i, pb)),
              "states": ((None, self.mb, w, n), lambda i: (chunk + i, mb, pb, 0))}
    return [self.plgpu.BlockSpec((q,), lambda i: (chunk + i,)) if name == "t"
            else self.plgpu.BlockSpec(*blocks[name], transforms=self.transforms)
            for name in names]

  def modes(self):
    return pl.ds(lax.axis_index("mb") * self.mb, self.mb)

  @staticmethod
  def columns():
    return pl.ds(lax.axis_index("pb") * COLUMNS, COLUMNS)

  def decays(self, t_s, rates_ref, weights_ref):
    g = lax.axis_index("g")
    return _Decays(self.plgpu, t_s, rates_ref.at[g], weights_ref.at[g],
                   lax.axis_index("mb") * self.mb)

  def call(self, kernel, out_type, scratch, name, interpret, *args):
    """Runs `kernel` on the grid (g, pb, mb, c), a program per chunk."""
    plgpu, grid = self.plgpu, self.grid
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch,
        grid=(self.groups, grid.p // COLUMNS, grid.m_blocks, grid.chunks),
        grid_names=("g", "pb", "mb", "c"),
        compiler_params=_lane_params(plgpu), interpret=interpret_params(plgpu, interpret),
        kernel_name=name)(*args)

  def chunk_tiles(self, step, refs, names):
    """Runs step(*tiles) once, with the tiles `names` of this chunk TMA-copied from `refs`
    (this group's arrays) into shared memory; then waits for the kernel's copies out."""
    self.plgpu.emit_pipeline(lambda _, *tiles: step(*tiles), grid=(1,),
                             in_specs=self.tile_specs(*names))(*refs)
    self.plgpu.wait_smem_to_gmem(0)


def _f32(shape):
  return jax.ShapeDtypeStruct(shape, _F32)


# ----------------------------------------------------------------------------
# The walk over the chunks (XLA, elementwise).
# ----------------------------------------------------------------------------

def _keeps(grid: _Grid, rates, t):
  """e^{-r_j t_Q} per chunk and mode, [G, chunks, m_pad], from rates [G, m_pad] and the
  kernels' t [G, length] (t_Q: each chunk's last entry)."""
  t_end = t.reshape(t.shape[0], grid.chunks, CHUNK)[..., -1]
  return jnp.exp(-rates[:, None, :] * t_end[..., None])


def _affine(earlier, later):
  """Composition of two steps v -> a v + b (`earlier` applied first)."""
  (a1, b1), (a2, b2) = earlier, later
  return a1 * a2, a2 * b1 + b2


def _walk(keeps, own, initial):
  """E_c = keeps_c E_{c-1} + own_c from E_{-1} = initial ([G, m_pad, P64, N]), as an
  associative scan over the chunks. Returns (the chunk-start states E_{c-1}
  [G, chunks, m_pad, P64, N], the final state E_{C-1})."""
  a = keeps[..., None, None]
  b = own.at[:, 0].add(a[:, 0] * initial)
  _, ends = lax.associative_scan(_affine, (a, b), axis=1)
  return jnp.concatenate([initial[:, None], ends[:, :-1]], axis=1), ends[:, -1]


def _walk_back(keeps, own, dfinal):
  """The chunk-end states' cotangents: dE_{c-1} = keeps_c dE_c + own_c (own: each chunk's
  own cotangent of its start states) from dE_{C-1} = dfinal, scanned from the last chunk.
  Returns (dE [G, chunks, m_pad, P64, N], the initial state's cotangent)."""
  a = keeps[..., None, None]
  b = own.at[:, -1].add(a[:, -1] * dfinal)
  _, dstarts = lax.associative_scan(_affine, (a, b), axis=1, reverse=True)
  return jnp.concatenate([dstarts[:, 1:], dfinal[:, None]], axis=1), dstarts[:, 0]


# ----------------------------------------------------------------------------
# Each chunk's own states (forward) and own state cotangents (backward).
# ----------------------------------------------------------------------------

def _own_states(k: _Kernel, interpret, cols, tokens, t, rates, weights, *, backward: bool):
  """Per chunk and mode j, transposed [64, N]: x^T (bd * e^{-r_j (t_Q - t)}) (forward:
  `cols` x^T, `tokens` bd), the chunk's contribution to its end states; or dy^T (c * w_j
  e^{-r_j t}) (backward: `cols` dy, `tokens` c), its outputs' cotangent of its start states.
  All modes in a program (k), `at_once` = 64 / N accumulators [64, N] at a time (32
  registers a thread). Returns [G, chunks, m_pad, P64, N] float32."""
  plgpu, q, w, n = k.plgpu, CHUNK, COLUMNS, k.n
  at_once = min(k.mb, max(1, 64 // n))

  def kernel(cols_ref, tok_ref, t_ref, rates_ref, weights_ref, out_ref, op_s, f32_s):
    g, chunk = lax.axis_index("g"), lax.axis_index("c")

    def step(cols_s, tok_s, t_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      tok_f = _load(plgpu, tok_s)
      a = cols_s.transpose((1, 0)) if backward else cols_s
      for j0 in range(0, k.mb, at_once):
        scales = []
        for j in range(j0, min(j0 + at_once, k.mb)):
          rate, weight = dec.mode(j)
          scales.append(weight * dec.grow(rate) if backward else dec.out_of(rate))
        store_operands(plgpu, [(op_s.at[i], tok_f * _rows(s, (q, n)))
                               for i, s in enumerate(scales)])
        news = products(plgpu, (w, n), [(a, op_s.at[i]) for i in range(len(scales))])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last copy out has read f32_s
        for i, s in enumerate(news):
          f32_s[i] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(f32_s.at[pl.ds(0, len(news))],
                                out_ref.at[g, chunk, pl.ds(j0, len(news)), k.columns()])

    k.chunk_tiles(step, (cols_ref.at[g], tok_ref.at[g], t_ref.at[g]),
                  ("dy", "c", "t") if backward else ("xt", "bd", "t"))

  grid = k.grid
  out_type = _f32((k.groups, grid.chunks, k.plan.m_pad, grid.p, n))
  scratch = [k.operand((at_once, q, n)), k.staging((at_once, w, n))]
  name = "frac_scan_bwd_own" if backward else "frac_scan_fwd_own"
  return k.call(kernel, out_type, scratch, name, interpret, cols, tokens, t, rates, weights)


# ----------------------------------------------------------------------------
# Forward: own states, the walk, the outputs.
# ----------------------------------------------------------------------------

def forward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, state, *,
            save_starts: bool):
  """Each chunk's own end states (`_own_states`), the chunk-start states (`_walk`), then
  y = (cb * Lmix) x + the state terms (`_outputs`)."""
  k = _Kernel(plan, blocks, x, all_modes=True)
  grid = k.grid
  xt, c_in, bd_in, t_in = _inputs(grid, x, bd, c, t)
  rates, weights = modes.rates[:, 0], modes.weights[:, 0]
  own = _own_states(k, interpret, xt, bd_in, t_in, rates, weights, backward=False)
  starts, final = _walk(_keeps(grid, rates, t_in), own, _state_t(grid, state))
  y = _outputs(k, interpret, xt, c_in, bd_in, t_in, rates, weights, starts.astype(k.low))
  y = y[:, :plan.length, :plan.p].astype(k.low)
  return y, _state_shared(grid, final), _state_shared(grid, starts) if save_starts else None


def _outputs(k: _Kernel, interpret, *args):
  """y = (cb * Lmix) x + sum_j (c * w_j e^{-r_j t}) S_j per chunk (cb = c bd^T; S_j the
  chunk-start states in the input dtype), one accumulator over all modes (k); the operands
  c * w_j e^{-r_j t} go through one buffer of `_MODES_PER_WAIT` modes."""
  plgpu, q, w, n = k.plgpu, CHUNK, COLUMNS, k.n
  per_wait = min(k.mb, _MODES_PER_WAIT)

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, s_ref, y_ref, pm_s, cg_s,
             y_s):
    g, chunk = lax.axis_index("g"), lax.axis_index("c")

    def step(xt_s, c_s, bd_s, t_s, s_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      (cb,) = products(plgpu, (q, q), [(c_s, bd_s.transpose((1, 0)))])
      store_operands(plgpu, [(pm_s, cb * dec.lmix(k.mb))])
      c_f = _load(plgpu, c_s)

      def run(acc):
        mma(plgpu, acc, pm_s, xt_s.transpose((1, 0)), accumulate=False)
        for j0 in range(0, k.mb, per_wait):
          modes = range(j0, min(j0 + per_wait, k.mb))
          if j0:
            mma_wait(plgpu, acc)  # the last modes' operands have been read
          for i, j in enumerate(modes):  # each stored as made: few registers
            rate, weight = dec.mode(j)
            cg_s[i] = (c_f * _rows(weight * dec.grow(rate), (q, n))).astype(k.low)
          plgpu.commit_smem()
          for i, j in enumerate(modes):
            mma(plgpu, acc, cg_s.at[i], s_s.at[j].transpose((1, 0)))
        mma_wait(plgpu, acc)
        return read(plgpu, acc)[0]

      y_s[...] = accumulators(plgpu, run, (q, w))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(y_s, y_ref.at[g, pl.ds(chunk * CHUNK, CHUNK), k.columns()])

    k.chunk_tiles(step, (xt_ref.at[g], c_ref.at[g], bd_ref.at[g], t_ref.at[g], s_ref.at[g]),
                  ("xt", "c", "bd", "t", "states"))

  scratch = [k.operand((q, q)), k.operand((per_wait, q, n)), k.staging((q, w))]
  return k.call(kernel, _f32((k.groups, k.grid.length, k.grid.p)), scratch,
                "frac_scan_fwd_out", interpret, *args)


# ----------------------------------------------------------------------------
# Backward: own state cotangents, the walk back, then per chunk the terms inside it and
# the terms through its states (two kernels, whose shares XLA adds).
# ----------------------------------------------------------------------------

def backward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, starts, dy, dstate):
  """The gradients as `frac_chunk.chunk_backward`'s: each chunk's own cotangent of its start
  states (`_own_states`), the chunk-end states' cotangents (`_walk_back`), then per chunk the
  in-chunk terms (`_intra`) and the state terms (`_state_grads`); the keep decays
  e^{-r_j t_Q} (XLA, `_keeps`) are differentiated by JAX.

  Per-token results of t and the mode cotangents come out as vectors whose totals (or sums
  with other programs' shares) XLA takes: for t, the terms at t_t [Q] (rows), at t_tau [Q]
  (the column sums of d(delta)) and a vector whose total is the cotangent of the chunk's
  end t_Q; for each mode, vectors whose totals are its rate's and weight's cotangents."""
  k, k_all = _Kernel(plan, blocks, x), _Kernel(plan, blocks, x, all_modes=True)
  grid = k.grid
  xt, c_in, bd_in, t_in = _inputs(grid, x, bd, c, t)
  dy_in = _columns(grid, dy).astype(k.low)
  rates, weights = modes.rates[:, 0], modes.weights[:, 0]
  own = _own_states(k_all, interpret, dy_in, c_in, t_in, rates, weights, backward=True)
  keeps, keeps_vjp = jax.vjp(functools.partial(_keeps, grid), rates, t_in)
  starts = _state_t(grid, starts)
  dends, ds0 = _walk_back(keeps, own, _state_t(grid, dstate))
  drates_keep, dt_keep = keeps_vjp(jnp.sum(dends * starts, axis=(-2, -1)))
  args = (xt, c_in, bd_in, t_in, rates, weights, dy_in)
  dx, dc, dbd, dt_a, dmodes = _intra(k_all, interpret, *args)
  dx_st, dc_st, dbd_st, dt_b, dmodes_st = _state_grads(
      k, interpret, *args, starts.astype(k.low), dends.astype(k.low))
  tokens = lambda a, b: (jnp.sum(a, axis=1) + jnp.sum(b, axis=1))[:, :plan.length]
  dt_a, dt_b = jnp.sum(dt_a, axis=1), jnp.sum(dt_b, axis=1)
  ends = jnp.sum(dt_b[:, 1].reshape(k.groups, grid.chunks, CHUNK), axis=-1)
  dt_kernel = (dt_a[:, 0] + dt_a[:, 1] + dt_b[:, 0]).reshape(k.groups, grid.chunks, CHUNK)
  dt_kernel = dt_kernel.at[:, :, -1].add(ends).reshape(k.groups, grid.length) + dt_keep
  # t was padded with its last value: that value's cotangent collects the padding's.
  _, pad_vjp = jax.vjp(lambda a: _pad_tokens(grid, a, mode="edge"), t[..., 0])
  (dt,) = pad_vjp(dt_kernel)
  dmodes = jnp.sum(dmodes + dmodes_st, axis=(1, 2, 5))             # [G, 2 (w, r), m_pad]
  return (tokens(dx, dx_st)[..., :plan.p], tokens(dbd, dbd_st), tokens(dc, dc_st), dt[..., None],
          Modes((dmodes[:, 1] + drates_keep)[:, None], dmodes[:, None, 0]),
          _state_shared(grid, ds0))


class _Grads:
  """The backward kernels' outputs and their staging buffers: per chunk dx [Q, 64] (this
  mode block's share), dc and dbd [Q, N] and two [Q] vectors of t (this program's share),
  and the per-mode vectors [2, m_block, Q] (weights, rates) that the kernel writes into the
  last buffer before `write`."""

  def __init__(self, k: _Kernel):
    self.k = k
    q, w, n, groups, grid = CHUNK, COLUMNS, k.n, k.groups, k.grid
    shares = grid.p // w * grid.m_blocks
    tokens = (groups, shares, grid.length)
    self.out_type = [_f32((groups, grid.m_blocks, grid.length, grid.p)), _f32(tokens + (n,)),
                     _f32(tokens + (n,)), _f32((groups, shares, 2, grid.length)),
                     _f32((groups, grid.chunks, grid.p // w, 2, k.plan.m_pad, q))]
    self.scratch = [k.staging((q, w)), k.staging((q, n)), k.staging((q, n)),
                    k.plgpu.SMEM((2, q), _F32), k.plgpu.SMEM((2, k.mb, q), _F32)]

  def write(self, refs, bufs, dx, dc, dbd, dt0, dt1):
    """Copies this chunk's results out (the mode vectors from bufs[4])."""
    plgpu, k = self.k.plgpu, self.k
    dx_s, dc_s, dbd_s, dt_s, modes_s = bufs
    g, pb, mb, chunk = (lax.axis_index(a) for a in ("g", "pb", "mb", "c"))
    share, tokens = pb * k.grid.m_blocks + mb, pl.ds(chunk * CHUNK, CHUNK)
    dx_s[...], dc_s[...], dbd_s[...] = dx, dc, dbd
    dt_s[0], dt_s[1] = dt0, dt1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dx_s, refs[0].at[g, mb, tokens, k.columns()])
    plgpu.copy_smem_to_gmem(dc_s, refs[1].at[g, share, tokens])
    plgpu.copy_smem_to_gmem(dbd_s, refs[2].at[g, share, tokens])
    plgpu.copy_smem_to_gmem(dt_s, refs[3].at[g, share, :, tokens])
    plgpu.copy_smem_to_gmem(modes_s, refs[4].at[g, chunk, pb, :, k.modes()])


def _zeros(plgpu, axis):
  """A [Q] float32 vector of zeros indexed by row (axis 1 reduced) or by column (axis 0)."""
  return plgpu.layout_cast(jnp.zeros((CHUNK,), _F32), plgpu.Layout.WGMMA.reduce(axis))


def _intra(k: _Kernel, interpret, *args):
  """Inside each chunk: dx = (cb Lmix)^T dy, dc = (dscores Lmix) bd, dbd = (dscores Lmix)^T c
  with dscores = dy x^T, and the cotangents through Lmix = sum_j w_j exp(-r_j delta):
  of w_j, r_j, and of t (d(delta)'s row sums at t_t, minus its column sums at t_tau).
  All modes (k); each mode's vectors go to shared memory as they are made."""
  plgpu, q, n = k.plgpu, CHUNK, k.n
  out = _Grads(k)

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, dy_ref, *rest):
    refs, (pm_s, dcb_s, *bufs) = rest[:5], rest[5:]
    g, modes_s = lax.axis_index("g"), bufs[4]

    def step(xt_s, c_s, bd_s, t_s, dy_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      lmix = dec.lmix(k.mb)
      cb, dscores = products(plgpu, (q, q), [(c_s, bd_s.transpose((1, 0))), (dy_s, xt_s)])
      store_operands(plgpu, [(pm_s, cb * lmix), (dcb_s, dscores * lmix)])
      dlmix = jnp.where(dec.causal, dscores * cb, 0.0)
      dt_rows, dt_cols = _zeros(plgpu, 1), _zeros(plgpu, 0)
      for j in range(k.mb):
        rate, weight = dec.mode(j)
        gl = dlmix * dec.decay(rate)
        rows = jnp.sum(gl, axis=1)
        modes_s[0, j] = rows
        modes_s[1, j] = -weight * jnp.sum(gl * dec.delta, axis=1)
        dt_rows -= (weight * rate) * rows
        dt_cols += (weight * rate) * jnp.sum(gl, axis=0)
      dc, dbd = products(plgpu, (q, n), [(dcb_s, bd_s), (dcb_s.transpose((1, 0)), c_s)])
      (dx,) = products(plgpu, (q, COLUMNS), [(pm_s.transpose((1, 0)), dy_s)])
      out.write(refs, bufs, dx, dc, dbd, dt_rows, dt_cols)

    k.chunk_tiles(step, tuple(r.at[g] for r in (xt_ref, c_ref, bd_ref, t_ref, dy_ref)),
                  ("xt", "c", "bd", "t", "dy"))

  scratch = [k.operand((q, q)), k.operand((q, q))] + out.scratch
  return k.call(kernel, out.out_type, scratch, "frac_scan_bwd_intra", interpret, *args)


def _state_grads(k: _Kernel, interpret, *args):
  """Per chunk, given its start states S_j and its end states' cotangents dE_j (both
  transposed [64, N], in the input dtype), the cotangents of c, bd, x and the decays (into
  w_j, r_j, t) through y += (c * w_j e^{-r_j t}) S_j and
  E_j = e^{-r_j t_Q} S_j + (bd * e^{-r_j (t_Q - t)})^T x (the keep decays' are XLA's)."""
  plgpu, q, w, n = k.plgpu, CHUNK, COLUMNS, k.n
  out = _Grads(k)

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, dy_ref, s_ref, ds_ref,
             *rest):
    refs, (bo_s, *bufs) = rest[:5], rest[5:]
    g, modes_s = lax.axis_index("g"), bufs[4]

    def step(xt_s, c_s, bd_s, t_s, dy_s, s_s, ds_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      c_f, bd_f = _load(plgpu, c_s), _load(plgpu, bd_s)
      dc = dbd = 0.0
      dt_rows, dt_end = _zeros(plgpu, 1), _zeros(plgpu, 1)
      for j in range(k.mb):
        d_c_in, d_bd_out = products(plgpu, (q, n), [(dy_s, s_s.at[j]),
                                                     (xt_s.transpose((1, 0)), ds_s.at[j])])
        rate, weight = dec.mode(j)
        grow, out_of = dec.grow(rate), dec.out_of(rate)
        into = weight * grow
        # y += (c * into) S_j
        dc += d_c_in * _rows(into, (q, n))
        d_into = jnp.sum(d_c_in * c_f, axis=1)
        # E_j = keep S_j + (bd * out_of)^T x
        dbd += d_bd_out * _rows(out_of, (q, n))
        store_operands(plgpu, [(bo_s.at[j], bd_f * _rows(out_of, (q, n)))])
        # Through the decays: g = (cotangent of a decay) * (that decay).
        g_in = d_into * into
        g_out = jnp.sum(d_bd_out * bd_f, axis=1) * out_of
        modes_s[0, j] = d_into * grow
        modes_s[1, j] = -(g_in * dec.t + g_out * (dec.t_end - dec.t))
        dt_rows += (g_out - g_in) * rate
        dt_end -= g_out * rate
      dx = product_sum(plgpu, (q, w), [(bo_s.at[j], ds_s.at[j].transpose((1, 0)))
                                        for j in range(k.mb)])
      out.write(refs, bufs, dx, dc, dbd, dt_rows, dt_end)

    tiles = (xt_ref, c_ref, bd_ref, t_ref, dy_ref, s_ref, ds_ref)
    k.chunk_tiles(step, tuple(r.at[g] for r in tiles),
                  ("xt", "c", "bd", "t", "dy", "states", "states"))

  scratch = [k.operand((k.mb, q, n))] + out.scratch
  return k.call(kernel, out.out_type, scratch, "frac_scan_bwd_states", interpret, *args)
