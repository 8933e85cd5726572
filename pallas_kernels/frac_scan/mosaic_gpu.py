"""FRAC scan on Hopper GPUs (Mosaic GPU, jax >= 0.11.2): WGMMA with float32 accumulators, one
warpgroup per program, grid (group g, block pb of 64 columns of P, block mb of modes[, chunk]).

WGMMA wants M = 64 rows, so a chunk is Q = 64 tokens (the token axis is M of the [Q, *]
products) and the states are kept transposed, S_j^T [64, N] (P is M of the state update;
N = 16 is a legal WGMMA N). Per chunk, with the notation of `jaxops.frac_chunk`::

  cb     = c bd^T                                    [Q, Q]   (c, bd: A and B^T in SMEM)
  y      = (cb * Lmix) x  +  sum_j (c * w_j e^{-r_j t}) S_j
  S_j^T <- e^{-r_j t_Q} S_j^T  +  (x^T * e^{-r_j (t_Q - t)}) bd      [64, N]

Each direction is two kernels, whose per-token and per-mode results are shares that XLA
adds (as the Triton kernel's): the terms inside a chunk (through cb and Lmix: no state, so
a program per chunk and all modes, which fills the GPU however few the groups), and the
state terms, a walk over the chunks (`plgpu.emit_pipeline`: TMA copies of the next chunk
overlap this one) carrying a block of modes' states (forward) or their cotangents
(backward, from the last chunk, reading the saved chunk-start states: the op's shared
format, `TilePlan`) in registers. One kernel per direction would hold too many values for
the register file. Registers (ptxas, H100, the benchmark shape, bf16, tuned blocks): forward
143 (chunks) and 148 (walk), backward 255 (chunks, spilling 80 B) and 241 (walk).

Operands. WGMMA reads B (and here A) from shared memory; values computed in registers are
written there first. Every operand is in the input dtype: products of bf16 inputs run on
the tensor cores in bf16, and so do the state terms (the states are float32 in registers,
rounded to bf16 as operands; TF32 would need K-major copies of every state operand). For
float32 inputs the same code runs in the interpreter only: on a real chip `dispatch`
refuses float32 Mosaic GPU kernels (`dispatch.mosaic_gpu_dtype_ok`).

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

from jaxops import tiling
from jaxops.frac_chunk import Modes, TilePlan
from pallas_kernels.dispatch import mosaic_gpu_module
from pallas_kernels.mosaic_gpu_common import (interpret_params, products, smem_transforms,
                                              store_operands)

_F32 = jnp.float32
CHUNK = 64     # tokens per chunk: WGMMA's M
COLUMNS = 64   # columns of P per program: M of the state update


def unsupported(plan: TilePlan) -> str | None:
  """Why the kernel cannot serve this plan (None: it can). It needs 64-token chunks (or one
  chunk holding the whole sequence) and N <= 32 (N = 64's float32 state blocks would take
  TMA copies of more dimensions than it has)."""
  if not (plan.chunk == CHUNK or (plan.num_chunks == 1 and plan.chunk < CHUNK)):
    return (f"needs `chunk`={CHUNK} (or a sequence of at most one chunk), got chunk "
            f"{plan.chunk}")
  if plan.n > 32:
    return f"needs N <= 32 (the last dim of `b`), got {plan.n} after padding to a power of two"
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
  """m_block: every mode (the in-chunk kernels: no states, and Lmix sums the modes), or (the
  state walks) the tuned count, at most 64 / N (N >= 16, a power of two): a program's
  states, their operands and staging scale with m_block * N, and 4 modes at N = 32 overflow
  the backward's shared memory (246 KiB > 227 KiB)."""
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


def _columns_t(grid: _Grid, a):
  """[G, Lp, p] -> [G, P64, length]: x (or dy) transposed, zero-padded."""
  a = _pad_tokens(grid, a)
  return jnp.pad(jnp.swapaxes(a, 1, 2), ((0, 0), (0, grid.p - a.shape[2]), (0, 0)))


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

  def out_of(self, rate, t):
    """e^{-r (t_Q - t)}: from token t to the chunk end, on the layout of `t`."""
    return jnp.exp(-rate * (self.t_end - t))

  def keep(self, rate):
    """e^{-r t_Q}: over the whole chunk (a scalar)."""
    return jnp.exp(-rate * self.t_end)


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
  """What the forward and backward kernels share: the plan, the operand layouts and the
  per-program state I/O (states [64, n] float32 in registers, transposed)."""

  def __init__(self, plan: TilePlan, blocks, x, *, all_modes: bool = False):
    self.plgpu = plgpu = mosaic_gpu_module()
    self.plan, self.grid = plan, _grid(plan, blocks, all_modes)
    self.low, self.n, self.mb = x.dtype, plan.n, self.grid.m_block
    self.groups, self.stages = x.shape[0], blocks.num_stages
    self.transforms = smem_transforms(plgpu, self.low, self.n, CHUNK, COLUMNS)

  def operand(self, shape):
    """A shared-memory WGMMA operand in the input dtype."""
    return self.plgpu.SMEM(shape, self.low, transforms=self.transforms)

  def staging(self, shape):
    """A float32 shared-memory buffer for results, swizzled so that storing WGMMA-layout
    values into it is free of bank conflicts."""
    plgpu = self.plgpu
    return plgpu.SMEM(shape, _F32, transforms=smem_transforms(plgpu, _F32, shape[-1]))

  def spec(self, shape, index, dtype=None):
    """A pipeline block spec, swizzled as the operands (or as float32 staging)."""
    transforms = (self.transforms if dtype is None
                  else smem_transforms(self.plgpu, dtype, shape[-1]))
    return self.plgpu.BlockSpec(shape, index, transforms=transforms)

  def token_specs(self, chunk_of):
    """Pipeline specs of x^T, c, bd and t for the chunk `chunk_of(step)`."""
    q, w, n, pb = CHUNK, COLUMNS, self.n, lax.axis_index("pb")
    return [self.spec((w, q), lambda i: (pb, chunk_of(i))),
            self.spec((q, n), lambda i: (chunk_of(i), 0)),
            self.spec((q, n), lambda i: (chunk_of(i), 0)),
            self.plgpu.BlockSpec((q,), lambda i: (chunk_of(i),))]

  def load_states(self, ref, f32_s, bar):
    """This program's m_block states [64, n] from `ref` [m_pad, P64, n], through f32_s
    [m_block, 64, n] (one copy: a second into the same buffer would race the loads)."""
    plgpu = self.plgpu
    plgpu.copy_gmem_to_smem(ref.at[self.modes(), self.columns()], f32_s, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    return tuple(plgpu.load(f32_s.at[j], layout=plgpu.Layout.WGMMA) for j in range(self.mb))

  def write_states(self, states, ref, f32_s):
    """Inverse of `load_states`; waits for every copy to finish."""
    plgpu = self.plgpu
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # f32_s's last copy has read it
    for j, s in enumerate(states):
      f32_s[j] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(f32_s, ref.at[self.modes(), self.columns()])
    plgpu.wait_smem_to_gmem(0)

  def modes(self):
    return pl.ds(lax.axis_index("mb") * self.mb, self.mb)

  @staticmethod
  def columns():
    return pl.ds(lax.axis_index("pb") * COLUMNS, COLUMNS)

  def decays(self, t_s, rates_ref, weights_ref):
    g = lax.axis_index("g")
    return _Decays(self.plgpu, t_s, rates_ref.at[g], weights_ref.at[g],
                   lax.axis_index("mb") * self.mb)

  def call(self, kernel, out_type, scratch, name, interpret, *args, per_chunk=False):
    """Runs `kernel` on the grid (g, pb, mb), with a fourth axis "c" over the chunks if
    `per_chunk` (one chunk a program)."""
    plgpu, grid = self.plgpu, self.grid
    extra = ((grid.chunks,), ("c",)) if per_chunk else ((), ())
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch + [plgpu.Barrier(num_barriers=1)],
        grid=(self.groups, grid.p // COLUMNS, grid.m_blocks) + extra[0],
        grid_names=("g", "pb", "mb") + extra[1],
        compiler_params=_lane_params(plgpu), interpret=interpret_params(plgpu, interpret),
        kernel_name=name)(*args)


def _f32(shape):
  return jax.ShapeDtypeStruct(shape, _F32)


# ----------------------------------------------------------------------------
# Forward: two kernels, whose shares of y XLA adds.
# ----------------------------------------------------------------------------

def forward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, state, *,
            save_starts: bool):
  """y = (cb * Lmix) x (`_forward_intra`, a program per chunk and all modes) plus the state
  terms and the states themselves (`_forward_states`, the walk over the chunks)."""
  k = _Kernel(plan, blocks, x)
  grid = k.grid
  args = (*_inputs(grid, x, bd, c, t), modes.rates[:, 0], modes.weights[:, 0])
  y_intra = _forward_intra(_Kernel(plan, blocks, x, all_modes=True), interpret, *args)
  y_states, final, starts = _forward_states(k, interpret, save_starts, *args,
                                            _state_t(grid, state))
  y = jnp.sum(y_intra, axis=1) + jnp.sum(y_states, axis=1)
  y = y[:, :plan.length, :plan.p].astype(k.low)
  starts = _state_shared(grid, starts) if save_starts else None
  return y, _state_shared(grid, final), starts


def _y_shape(k: _Kernel):
  """y's shares, one per mode block: [G, m_blocks, length, P64]."""
  return _f32((k.groups, k.grid.m_blocks, k.grid.length, k.grid.p))


def _write_y(k: _Kernel, y, y_s, y_ref, i):
  """Stages chunk i's share of y [Q, 64] and copies it out (after the last copy read y_s)."""
  plgpu = k.plgpu
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  y_s[...] = y
  plgpu.commit_smem()
  g, mb = lax.axis_index("g"), lax.axis_index("mb")
  plgpu.copy_smem_to_gmem(y_s, y_ref.at[g, mb, pl.ds(i * CHUNK, CHUNK), k.columns()])


def _forward_intra(k: _Kernel, interpret, *args):
  """(cb * Lmix) x, cb = c bd^T: a program per chunk (k: all modes in one block)."""
  plgpu, q, w, mb_size = k.plgpu, CHUNK, COLUMNS, k.mb

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, y_ref, pm_s, y_s, _):
    g, chunk = lax.axis_index("g"), lax.axis_index("c")

    def step(_, xt_s, c_s, bd_s, t_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      (cb,) = products(plgpu, (q, q), [(c_s, bd_s.transpose((1, 0)))])
      store_operands(plgpu, [(pm_s, cb * dec.lmix(mb_size))])
      (y,) = products(plgpu, (q, w), [(pm_s, xt_s.transpose((1, 0)))])
      _write_y(k, y, y_s, y_ref, chunk)

    plgpu.emit_pipeline(step, grid=(1,), in_specs=k.token_specs(lambda i: chunk + i))(
        xt_ref.at[g], c_ref.at[g], bd_ref.at[g], t_ref.at[g])
    plgpu.wait_smem_to_gmem(0)

  return k.call(kernel, _y_shape(k), [k.operand((q, q)), k.staging((q, w))],
                "frac_scan_fwd_intra", interpret, *args, per_chunk=True)


def _forward_states(k: _Kernel, interpret, save_starts: bool, *args):
  """The walk over the chunks: y's state terms sum_j (c * w_j e^{-r_j t}) S_j and the
  update S_j^T <- e^{-r_j t_Q} S_j^T + (x^T * e^{-r_j (t_Q - t)}) bd, saving each chunk's
  start states when `save_starts`. Returns (y's shares, final states, starts or None), the
  states transposed ([..., m_pad, P64, n])."""
  plgpu, grid, q, w, n, mb_size = k.plgpu, k.grid, CHUNK, COLUMNS, k.n, k.mb

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, s0_ref, y_ref, s_ref,
             *rest):
    starts_ref, (cg_s, st_s, xo_s, y_s, starts_s, f32_s, bar) = (
        (rest[0], rest[1:]) if save_starts else (None, rest))
    g = lax.axis_index("g")

    def step(idx, xt_s, c_s, bd_s, t_s, states):
      (i,) = idx
      dec = k.decays(t_s, rates_ref, weights_ref)
      c_f, xt_f = _load(plgpu, c_s), _load(plgpu, xt_s)
      for j, s in enumerate(states):
        rate, weight = dec.mode(j)
        store_operands(plgpu, [(cg_s.at[j], c_f * _rows(weight * dec.grow(rate), (q, n))),
                       (st_s.at[j], s),
                       (xo_s.at[j], xt_f * _cols(dec.out_of(rate, dec.t_cols), (w, q)))])
      news = products(plgpu, (w, n), [(xo_s.at[j], bd_s) for j in range(mb_size)])

      def y_run(acc):
        for j in range(mb_size):
          plgpu.wgmma(acc, cg_s.at[j], st_s.at[j].transpose((1, 0)))
        return acc[...]

      _write_y(k, pl.run_scoped(y_run, plgpu.ACC((q, w), _F32)), y_s, y_ref, i)
      if save_starts:  # _write_y waited for every earlier copy, starts_s's too
        for j, s in enumerate(states):
          starts_s[j] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(starts_s, starts_ref.at[g, i, k.modes(), k.columns()])
      return tuple(dec.keep(dec.mode(j)[0]) * s + new
                   for j, (s, new) in enumerate(zip(states, news)))

    final = plgpu.emit_pipeline(
        step, grid=(grid.chunks,), in_specs=k.token_specs(lambda i: i),
        max_concurrent_steps=k.stages, init_carry=k.load_states(s0_ref.at[g], f32_s, bar),
    )(xt_ref.at[g], c_ref.at[g], bd_ref.at[g], t_ref.at[g])
    k.write_states(final, s_ref.at[g], f32_s)

  state_t = (k.groups, k.plan.m_pad, grid.p, n)
  out_type = [_y_shape(k), _f32(state_t)]
  if save_starts:
    out_type.append(_f32((k.groups, grid.chunks) + state_t[1:]))
  scratch = [k.operand((mb_size, q, n)), k.operand((mb_size, w, n)), k.operand((mb_size, w, q)),
             k.staging((q, w)), k.staging((mb_size, w, n)), k.staging((mb_size, w, n))]
  outs = k.call(kernel, out_type, scratch, "frac_scan_fwd_states", interpret, *args)
  return outs[0], outs[1], outs[2] if save_starts else None


# ----------------------------------------------------------------------------
# Backward: two kernels, whose shares XLA adds.
# ----------------------------------------------------------------------------

def backward(plan: TilePlan, blocks, interpret, x, bd, c, t, modes: Modes, starts, dy, dstate):
  """The gradients as `frac_chunk.chunk_backward`'s, in two kernels (one alone holds too
  many [Q, Q] and state values for the register file): `_intra` (the terms inside a chunk,
  through cb and Lmix; a program per chunk) and `_through_states` (the terms of the M
  states, chunk by chunk from the last, carrying their cotangents).

  Per-token results of t and the mode cotangents come out as vectors whose totals (or sums
  with other programs' shares) XLA takes: for t, the terms at t_t [Q] (rows), at t_tau [Q]
  (the column sums of d(delta)) and a vector whose total is the cotangent of the chunk's
  end t_Q; for each mode, vectors whose totals are its rate's and weight's cotangents.
  The keep-decay terms (sums of S * dS over the 64 columns of P) are added to vectors
  over the 64 tokens where only the total counts (CHUNK == COLUMNS)."""
  k = _Kernel(plan, blocks, x)
  grid = k.grid
  xt, c_in, bd_in, t_in = _inputs(grid, x, bd, c, t)
  dy_in = jnp.pad(_pad_tokens(grid, dy), ((0, 0), (0, 0), (0, grid.p - plan.p))).astype(k.low)
  args = (xt, c_in, bd_in, t_in, modes.rates[:, 0], modes.weights[:, 0], dy_in)
  dx, dc, dbd, dt_a, dmodes = _intra(_Kernel(plan, blocks, x, all_modes=True), interpret, *args)
  dx_s, dc_s, dbd_s, dt_b, dmodes_s, ds0 = _through_states(
      k, interpret, *args, _state_t(grid, starts), _state_t(grid, dstate))
  tokens = lambda a, b: (jnp.sum(a, axis=1) + jnp.sum(b, axis=1))[:, :plan.length]
  dt_a, dt_b = jnp.sum(dt_a, axis=1), jnp.sum(dt_b, axis=1)
  ends = jnp.sum(dt_b[:, 1].reshape(k.groups, grid.chunks, CHUNK), axis=-1)
  dt_kernel = (dt_a[:, 0] + dt_a[:, 1] + dt_b[:, 0]).reshape(k.groups, grid.chunks, CHUNK)
  dt_kernel = dt_kernel.at[:, :, -1].add(ends).reshape(k.groups, grid.length)
  # t was padded with its last value: that value's cotangent collects the padding's.
  _, pad_vjp = jax.vjp(lambda a: _pad_tokens(grid, a, mode="edge"), t[..., 0])
  (dt,) = pad_vjp(dt_kernel)
  dmodes = jnp.sum(dmodes, axis=1) + dmodes_s                         # over the chunks
  dmodes = jnp.sum(dmodes, axis=(1, 4))[:, :, None]                  # [G, 2, 1, m_pad]
  return (tokens(dx, dx_s)[..., :plan.p], tokens(dbd, dbd_s), tokens(dc, dc_s), dt[..., None],
          Modes(dmodes[:, 1], dmodes[:, 0]), _state_shared(grid, ds0))


class _Grads:
  """The backward kernels' per-token outputs and their staging buffers: dx [Q, 64] (this
  mode block's share), dc and dbd [Q, N] and two [Q] vectors of t (this program's share);
  and the per-mode vectors [2, m_block, 64] (weights, rates) written once at the end, per
  chunk where a program has one chunk."""

  def __init__(self, k: _Kernel, per_chunk: bool):
    self.k = k
    q, w, n, groups, grid = CHUNK, COLUMNS, k.n, k.groups, k.grid
    shares = grid.p // w * grid.m_blocks
    tokens = (groups, shares, grid.length)
    chunks = (grid.chunks,) if per_chunk else ()
    self.out_type = [_f32((groups, grid.m_blocks, grid.length, grid.p)), _f32(tokens + (n,)),
                     _f32(tokens + (n,)), _f32((groups, shares, 2, grid.length)),
                     _f32((groups,) + chunks + (grid.p // w, 2, k.plan.m_pad, q))]
    self.scratch = [k.staging((q, w)), k.staging((q, n)), k.staging((q, n)),
                    k.plgpu.SMEM((2, q), _F32), k.plgpu.SMEM((2, k.mb, q), _F32)]

  def write_chunk(self, refs, bufs, i, dx, dc, dbd, dt0, dt1):
    """Copies chunk i's results out (after the previous chunk's copies have read the
    buffers)."""
    plgpu, k = self.k.plgpu, self.k
    dx_ref, dc_ref, dbd_ref, dt_ref = refs[:4]
    dx_s, dc_s, dbd_s, dt_s = bufs[:4]
    g, pb, mb = lax.axis_index("g"), lax.axis_index("pb"), lax.axis_index("mb")
    share, tokens = pb * k.grid.m_blocks + mb, pl.ds(i * CHUNK, CHUNK)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    dx_s[...], dc_s[...], dbd_s[...] = dx, dc, dbd
    dt_s[0], dt_s[1] = dt0, dt1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dx_s, dx_ref.at[g, mb, tokens, k.columns()])
    plgpu.copy_smem_to_gmem(dc_s, dc_ref.at[g, share, tokens])
    plgpu.copy_smem_to_gmem(dbd_s, dbd_ref.at[g, share, tokens])
    plgpu.copy_smem_to_gmem(dt_s, dt_ref.at[g, share, :, tokens])

  def write_modes(self, ref, buf, dweights, drates):
    """Into ref [P64 / 64, 2, m_pad, 64] (this group's, or this group's and chunk's)."""
    plgpu = self.k.plgpu
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for j, (dw, dr) in enumerate(zip(dweights, drates)):
      buf[0, j], buf[1, j] = dw, dr
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf, ref.at[lax.axis_index("pb"), :, self.k.modes()])


def _zeros(plgpu, axis):
  """A [Q] float32 vector of zeros indexed by row (axis 1 reduced) or by column (axis 0)."""
  return plgpu.layout_cast(jnp.zeros((CHUNK,), _F32), plgpu.Layout.WGMMA.reduce(axis))


def _intra(k: _Kernel, interpret, *args):
  """Inside each chunk: dx = (cb Lmix)^T dy, dc = (dscores Lmix) bd, dbd = (dscores Lmix)^T c
  with dscores = dy x^T, and the cotangents through Lmix = sum_j w_j exp(-r_j delta):
  of w_j, r_j, and of t (d(delta)'s row sums at t_t, minus its column sums at t_tau).
  Nothing is carried between chunks: a program per chunk (grid axis "c") and all modes
  (k), so the GPU is full however few the groups (a one-step pipeline: its TMA copies and
  buffers); each mode's vectors go to shared memory as they are made."""
  plgpu, q, w, n, mb_size = k.plgpu, CHUNK, COLUMNS, k.n, k.mb
  out = _Grads(k, per_chunk=True)

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, dy_ref, *rest):
    refs, (pm_s, dcb_s, *bufs, _) = rest[:5], rest[5:]
    g, pb, chunk = lax.axis_index("g"), lax.axis_index("pb"), lax.axis_index("c")
    dmodes_s = bufs[4]

    def step(_, xt_s, c_s, bd_s, t_s, dy_s):
      dec = k.decays(t_s, rates_ref, weights_ref)
      lmix = dec.lmix(mb_size)
      cb, dscores = products(plgpu, (q, q), [(c_s, bd_s.transpose((1, 0))), (dy_s, xt_s)])
      store_operands(plgpu, [(pm_s, cb * lmix), (dcb_s, dscores * lmix)])
      dlmix = jnp.where(dec.causal, dscores * cb, 0.0)
      dt_rows, dt_cols = _zeros(plgpu, 1), _zeros(plgpu, 0)
      for j in range(mb_size):
        rate, weight = dec.mode(j)
        gl = dlmix * dec.decay(rate)
        rows = jnp.sum(gl, axis=1)
        dmodes_s[0, j] = rows
        dmodes_s[1, j] = -weight * jnp.sum(gl * dec.delta, axis=1)
        dt_rows -= (weight * rate) * rows
        dt_cols += (weight * rate) * jnp.sum(gl, axis=0)
      dc, dbd = products(plgpu, (q, n), [(dcb_s, bd_s), (dcb_s.transpose((1, 0)), c_s)])
      (dx,) = products(plgpu, (q, w), [(pm_s.transpose((1, 0)), dy_s)])
      out.write_chunk(refs, bufs, chunk, dx, dc, dbd, dt_rows, dt_cols)  # fences dmodes_s too
      plgpu.copy_smem_to_gmem(dmodes_s, refs[4].at[g, chunk, pb])

    plgpu.emit_pipeline(
        step, grid=(1,),
        in_specs=k.token_specs(lambda i: chunk + i) + [k.spec((q, w), lambda i: (chunk + i, pb))],
    )(xt_ref.at[g], c_ref.at[g], bd_ref.at[g], t_ref.at[g], dy_ref.at[g])
    plgpu.wait_smem_to_gmem(0)

  scratch = [k.operand((q, q)), k.operand((q, q))] + out.scratch
  return k.call(kernel, out.out_type, scratch, "frac_scan_bwd_intra", interpret, *args,
                per_chunk=True)


def _through_states(k: _Kernel, interpret, *args):
  """The state terms, chunk by chunk from the last, from the chunk-start states S_j and
  the carried cotangents dS_j (transposed, [64, N]): for y += (c * w_j e^{-r_j t}) S_j and
  S_j' = e^{-r_j t_Q} S_j + (bd * e^{-r_j (t_Q - t)})^T x, the cotangents of c, bd, x, the
  decays (into w_j, r_j, t) and S_j."""
  plgpu, grid, q, w, n, mb_size = k.plgpu, k.grid, CHUNK, COLUMNS, k.n, k.mb
  out = _Grads(k, per_chunk=False)
  last = grid.chunks - 1

  def kernel(xt_ref, c_ref, bd_ref, t_ref, rates_ref, weights_ref, dy_ref, starts_ref, ds_ref,
             *rest):
    refs, ds0_ref = rest[:5], rest[5]
    st_s, dst_s, cg_s, bo_s, *bufs, f32_s, bar = rest[6:]
    g, pb, mb = lax.axis_index("g"), lax.axis_index("pb"), lax.axis_index("mb")

    def step(idx, xt_s, c_s, bd_s, t_s, dy_s, start_s, carry):
      dstates, dweights, drates = (list(c) for c in carry)
      dec = k.decays(t_s, rates_ref, weights_ref)
      c_f, bd_f = _load(plgpu, c_s), _load(plgpu, bd_s)
      dc = dbd = 0.0
      dt_rows, dt_end = _zeros(plgpu, 1), _zeros(plgpu, 1)
      for j in range(mb_size):
        state = plgpu.load(start_s.at[j], layout=plgpu.Layout.WGMMA)
        store_operands(plgpu, [(st_s.at[j], state), (dst_s.at[j], dstates[j])])
        d_c_in, d_bd_out = products(plgpu, (q, n), [(dy_s, st_s.at[j]),
                                                     (xt_s.transpose((1, 0)), dst_s.at[j])])
        rate, weight = dec.mode(j)
        grow, out_of, keep = dec.grow(rate), dec.out_of(rate, dec.t), dec.keep(rate)
        into = weight * grow
        # y += (c * into) S_j
        dc += d_c_in * _rows(into, (q, n))
        d_into = jnp.sum(d_c_in * c_f, axis=1)
        # S_j' = keep S_j + (bd * out_of)^T x
        dbd += d_bd_out * _rows(out_of, (q, n))
        store_operands(plgpu, [(cg_s.at[j], c_f * _rows(into, (q, n))),
                       (bo_s.at[j], bd_f * _rows(out_of, (q, n)))])
        # Through the decays: g = (cotangent of a decay) * (that decay).
        g_in = d_into * into
        g_out = jnp.sum(d_bd_out * bd_f, axis=1) * out_of
        g_keep = jnp.sum(state * dstates[j], axis=1) * keep   # [64 columns]; its total
        dweights[j] += d_into * grow
        drates[j] -= g_in * dec.t + g_out * (dec.t_end - dec.t) + g_keep * dec.t_end
        dt_rows += (g_out - g_in) * rate
        dt_end -= (g_out + g_keep) * rate

      def dx_run(acc):
        for j in range(mb_size):
          plgpu.wgmma(acc, bo_s.at[j], dst_s.at[j].transpose((1, 0)))
        return acc[...]

      dx = pl.run_scoped(dx_run, plgpu.ACC((q, w), _F32))
      news = products(plgpu, (w, n), [(dy_s.transpose((1, 0)), cg_s.at[j])
                                       for j in range(mb_size)])
      out.write_chunk(refs, bufs, last - idx[0], dx, dc, dbd, dt_rows, dt_end)
      dstarts = tuple(dec.keep(dec.mode(j)[0]) * d + new
                      for j, (d, new) in enumerate(zip(dstates, news)))
      return dstarts, tuple(dweights), tuple(drates)

    zeros = (_zeros(plgpu, 1),) * mb_size
    dstates, dweights, drates = plgpu.emit_pipeline(
        step, grid=(grid.chunks,),
        in_specs=k.token_specs(lambda i: last - i) + [
            k.spec((q, w), lambda i: (last - i, pb)),
            k.spec((None, mb_size, w, n), lambda i: (last - i, mb, pb, 0), _F32)],
        max_concurrent_steps=k.stages,
        init_carry=(k.load_states(ds_ref.at[g], f32_s, bar), zeros, zeros),
    )(xt_ref.at[g], c_ref.at[g], bd_ref.at[g], t_ref.at[g], dy_ref.at[g], starts_ref.at[g])
    out.write_modes(refs[4].at[g], bufs[4], dweights, drates)
    k.write_states(dstates, ds0_ref.at[g], f32_s)

  out_type = out.out_type + [_f32((k.groups, k.plan.m_pad, grid.p, n))]
  scratch = ([k.operand((mb_size, w, n)), k.operand((mb_size, w, n)),
              k.operand((mb_size, q, n)), k.operand((mb_size, q, n))] + out.scratch
             + [k.staging((mb_size, w, n))])
  return k.call(kernel, out_type, scratch, "frac_scan_bwd_states", interpret, *args)
