"""Chunked FRAC scan (multi-mode diagonal SSM) as Pallas kernels, forward and backward.

Math, shapes and the reference: `jaxops.frac`. The per-chunk tile math (M modes folded
into one decay matrix inside a chunk, M states of [N, P] carried across chunks, all
decays from differences of cumulative dt) is `jaxops.frac_chunk`, shared with the
chunked XLA path. Per group g = (batch element, head), chunks c = 0..C-1::

  forward:   S = S0;  for c: starts[c] = S;  y_c, S = chunk_forward(inputs_c, S)
  backward:  dS = dS_final;  for c = C-1..0:  grads_c, dS = chunk_backward(inputs_c,
             starts[c], dy_c, dS)      (recomputes inside the chunk)

State and decays are float32 whatever the input dtype. Two lowerings:
- Mosaic (TPU): grid (group, chunk) with the chunk axis "arbitrary"; the state lives
  in a float32 VMEM scratch across it; rate/weight gradients accumulate in resident
  output blocks.
- Triton (GPU): grid (group,); grid steps cannot carry state, so a `fori_loop` walks
  the chunks inside the kernel, slicing them from refs.
Both use one tile layout (`TileLayout` with pow2 widths: chunk, P, N >= 16, M a power
of two; the padding is inert), so only the kernel call differs by platform.

`frac_scan` is the one public entry point; it dispatches with
`jax.lax.platform_dependent`: Mosaic on TPU, Triton on GPU, the Mosaic kernel in
interpret mode elsewhere (CPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxops.frac import check_scan_inputs, scan_vjp, zero_state
from jaxops.frac_chunk import Modes, TileLayout, chunk_backward, chunk_forward
from pallas_kernels.dispatch import Backend, KernelConfig, dispatch

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """`chunk`: tokens per chunk (rounded to a power of two >= 16, at most the padded L).

  Both lowerings share one tile layout, hence one chunk size.
  """

  chunk: int = 64

  @classmethod
  def for_backend(cls, backend: Backend, dtype=None) -> "BlockSizes":
    del backend  # one layout for both
    return cls()


# ----------------------------------------------------------------------------
# Mosaic (TPU): grid (group g, chunk i); the chunk axis carries the state.
# ----------------------------------------------------------------------------

def _read_modes(refs) -> Modes:
  return Modes(*(r[0] for r in refs))


def _mosaic_fwd_kernel(x_ref, bd_ref, c_ref, t_ref, *refs, save_starts):
  mode_refs, (rep_ref, s0_ref, y_ref, s_ref), rest = refs[:5], refs[5:9], refs[9:]
  starts_ref, state = rest if save_starts else (None, *rest)
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    state[...] = s0_ref[0]

  if save_starts:
    starts_ref[0, 0] = state[...]
  y, new_state = chunk_forward(x_ref[0], bd_ref[0], c_ref[0], t_ref[0], _read_modes(mode_refs),
                               rep_ref[...], state[...])
  y_ref[0] = y.astype(y_ref.dtype)
  state[...] = new_state

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    s_ref[0] = new_state


def _mosaic_bwd_kernel(x_ref, bd_ref, c_ref, t_ref, *refs):
  mode_refs = refs[:5]
  rep_ref, start_ref, dy_ref, ds_ref, dx_ref, dbd_ref, dc_ref, dt_ref = refs[5:13]
  dmode_refs, (ds0_ref, dstate) = refs[13:18], refs[18:]
  i = pl.program_id(1)

  @pl.when(i == 0)
  def _():
    dstate[...] = ds_ref[0]
    for r in dmode_refs:
      r[...] = jnp.zeros_like(r)

  dx, dbd, dc, dt, dmodes, ds = chunk_backward(
      x_ref[0], bd_ref[0], c_ref[0], t_ref[0], _read_modes(mode_refs), rep_ref[...],
      start_ref[0, 0], dy_ref[0], dstate[...])
  dx_ref[0], dbd_ref[0], dc_ref[0], dt_ref[0] = dx, dbd, dc, dt
  for r, d in zip(dmode_refs, dmodes):
    r[0] += d
  dstate[...] = ds

  @pl.when(i == pl.num_programs(1) - 1)
  def _():
    ds0_ref[0] = ds


def _specs(layout: TileLayout, token_index, group_index):
  """BlockSpecs of (x, bd, c, t, five mode forms, rep) for a grid (g, i)."""
  q, k, m = layout.chunk, layout.m * layout.n, layout.m
  tok = lambda w: pl.BlockSpec((1, q, w), token_index)
  group = lambda *s: pl.BlockSpec((1, *s), group_index)
  return ([tok(layout.p), tok(layout.n), tok(layout.n), tok(1),
           group(1, m), group(1, m), group(1, k), group(1, k), group(k, 1)]
          + [pl.BlockSpec((layout.n, k), lambda *_: (0, 0))])


def _mode_shapes(g, layout: TileLayout):
  k, m = layout.m * layout.n, layout.m
  return [jax.ShapeDtypeStruct(s, _F32) for s in ((g, 1, m), (g, 1, m), (g, 1, k), (g, 1, k),
                                                   (g, k, 1))]


def _mosaic_forward(layout: TileLayout, interpret, x, bd, c, t, modes, state, *, save_starts):
  g, k, p, n_chunks = x.shape[0], layout.m * layout.n, layout.p, layout.num_chunks
  group_index = lambda g, i: (g, 0, 0)
  out_specs = [pl.BlockSpec((1, layout.chunk, p), lambda g, i: (g, i, 0)),
               pl.BlockSpec((1, k, p), group_index)]
  out_shape = [jax.ShapeDtypeStruct(x.shape[:2] + (p,), x.dtype),
               jax.ShapeDtypeStruct((g, k, p), _F32)]
  if save_starts:
    out_specs.append(pl.BlockSpec((1, 1, k, p), lambda g, i: (g, i, 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((g, n_chunks, k, p), _F32))
  outs = pl.pallas_call(
      functools.partial(_mosaic_fwd_kernel, save_starts=save_starts),
      grid=(g, n_chunks),
      in_specs=_specs(layout, lambda g, i: (g, i, 0), group_index)
      + [pl.BlockSpec((1, k, p), group_index)],
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((k, p), _F32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="frac_scan_fwd",
  )(x, bd, c, t, *modes, layout.rep(), state)
  return (*outs, None) if not save_starts else tuple(outs)


def _mosaic_backward(layout: TileLayout, interpret, x, bd, c, t, modes, starts, dy, dstate):
  g, k, p, n_chunks = x.shape[0], layout.m * layout.n, layout.p, layout.num_chunks
  last = n_chunks - 1
  rev = lambda g, i: (g, last - i, 0)
  group_index = lambda g, i: (g, 0, 0)
  tok_specs = _specs(layout, rev, group_index)
  grads = pl.pallas_call(
      _mosaic_bwd_kernel,
      grid=(g, n_chunks),
      in_specs=tok_specs + [pl.BlockSpec((1, 1, k, p), lambda g, i: (g, last - i, 0, 0)),
                            tok_specs[0], pl.BlockSpec((1, k, p), group_index)],
      out_specs=tok_specs[:4] + tok_specs[4:9] + [pl.BlockSpec((1, k, p), group_index)],
      out_shape=[jax.ShapeDtypeStruct(a.shape, _F32) for a in (x, bd, c, t)]
      + _mode_shapes(g, layout) + [jax.ShapeDtypeStruct((g, k, p), _F32)],
      scratch_shapes=[pltpu.VMEM((k, p), _F32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=interpret,
      name="frac_scan_bwd",
  )(x, bd, c, t, *modes, layout.rep(), starts, dy, dstate)
  return (*grads[:4], Modes(*grads[4:9]), grads[9])


# ----------------------------------------------------------------------------
# Triton (GPU): grid (group g,); a fori_loop walks the chunks.
# ----------------------------------------------------------------------------

def _triton_fwd_kernel(x_ref, bd_ref, c_ref, t_ref, *refs, q, n_chunks, save_starts):
  mode_refs, (rep_ref, s0_ref, y_ref, s_ref), rest = refs[:5], refs[5:9], refs[9:]
  modes, rep = _read_modes(mode_refs), rep_ref[...]

  def body(i, state):
    rows = pl.ds(pl.multiple_of(i * q, q), q)
    if save_starts:
      rest[0][0, i] = state
    y, state = chunk_forward(x_ref[0, rows, :], bd_ref[0, rows, :], c_ref[0, rows, :],
                             t_ref[0, rows, :], modes, rep, state)
    y_ref[0, rows, :] = y.astype(y_ref.dtype)
    return state

  s_ref[0] = jax.lax.fori_loop(0, n_chunks, body, s0_ref[0])


def _triton_bwd_kernel(x_ref, bd_ref, c_ref, t_ref, *refs, q, n_chunks):
  mode_refs = refs[:5]
  rep_ref, starts_ref, dy_ref, ds_ref, dx_ref, dbd_ref, dc_ref, dt_ref = refs[5:13]
  dmode_refs, ds0_ref = refs[13:18], refs[18]
  modes, rep = _read_modes(mode_refs), rep_ref[...]

  def body(j, carry):
    dstate, dmodes = carry
    i = n_chunks - 1 - j
    rows = pl.ds(pl.multiple_of(i * q, q), q)
    dx, dbd, dc, dt, dm, dstate = chunk_backward(
        x_ref[0, rows, :], bd_ref[0, rows, :], c_ref[0, rows, :], t_ref[0, rows, :], modes,
        rep, starts_ref[0, i], dy_ref[0, rows, :], dstate)
    dx_ref[0, rows, :], dbd_ref[0, rows, :], dc_ref[0, rows, :] = dx, dbd, dc
    dt_ref[0, rows, :] = dt
    return dstate, Modes(*(a + b for a, b in zip(dmodes, dm)))

  init = (ds_ref[0], Modes(*(jnp.zeros_like(m) for m in modes)))
  ds0, dmodes = jax.lax.fori_loop(0, n_chunks, body, init)
  ds0_ref[0] = ds0
  for r, d in zip(dmode_refs, dmodes):
    r[0] = d


_TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)


def _whole_specs(layout: TileLayout):
  """BlockSpecs of (x, bd, c, t, five mode forms, rep) for a grid (g,): whole sequences."""
  k, m = layout.m * layout.n, layout.m
  group = lambda *s: pl.BlockSpec((1, *s), lambda g: (g,) + (0,) * len(s))
  return ([group(layout.length, w) for w in (layout.p, layout.n, layout.n, 1)]
          + [group(1, m), group(1, m), group(1, k), group(1, k), group(k, 1)]
          + [pl.BlockSpec((layout.n, k), lambda g: (0, 0))])


def _triton_forward(layout: TileLayout, interpret, x, bd, c, t, modes, state, *, save_starts):
  g, k, p, n_chunks = x.shape[0], layout.m * layout.n, layout.p, layout.num_chunks
  specs = _whole_specs(layout)
  group = lambda *s: pl.BlockSpec((1, *s), lambda g: (g,) + (0,) * len(s))
  out_specs = [specs[0], group(k, p)]
  out_shape = [jax.ShapeDtypeStruct(x.shape[:2] + (p,), x.dtype),
               jax.ShapeDtypeStruct((g, k, p), _F32)]
  if save_starts:
    out_specs.append(group(n_chunks, k, p))
    out_shape.append(jax.ShapeDtypeStruct((g, n_chunks, k, p), _F32))
  outs = pl.pallas_call(
      functools.partial(_triton_fwd_kernel, q=layout.chunk, n_chunks=n_chunks,
                        save_starts=save_starts),
      grid=(g,),
      in_specs=specs + [group(k, p)],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_TRITON_PARAMS,
      interpret=interpret,
      name="frac_scan_fwd",
  )(x, bd, c, t, *modes, layout.rep(), state)
  return (*outs, None) if not save_starts else tuple(outs)


def _triton_backward(layout: TileLayout, interpret, x, bd, c, t, modes, starts, dy, dstate):
  g, k, p, n_chunks = x.shape[0], layout.m * layout.n, layout.p, layout.num_chunks
  specs = _whole_specs(layout)
  group = lambda *s: pl.BlockSpec((1, *s), lambda g: (g,) + (0,) * len(s))
  grads = pl.pallas_call(
      functools.partial(_triton_bwd_kernel, q=layout.chunk, n_chunks=n_chunks),
      grid=(g,),
      in_specs=specs + [group(n_chunks, k, p), specs[0], group(k, p)],
      out_specs=specs[:9] + [group(k, p)],
      out_shape=[jax.ShapeDtypeStruct(a.shape, _F32) for a in (x, bd, c, t)]
      + _mode_shapes(g, layout) + [jax.ShapeDtypeStruct((g, k, p), _F32)],
      compiler_params=_TRITON_PARAMS,
      interpret=interpret,
      name="frac_scan_bwd",
  )(x, bd, c, t, *modes, layout.rep(), starts, dy, dstate)
  return (*grads[:4], Modes(*grads[4:9]), grads[9])


# ----------------------------------------------------------------------------
# Dispatch and autodiff.
# ----------------------------------------------------------------------------

_KERNELS = {
    "mosaic": (_mosaic_forward, _mosaic_backward),
    "triton": (_triton_forward, _triton_backward),
}


def _run(which: int, layout: TileLayout, backend: Backend, interpret, _blocks, *args,
         **kwargs):
  """The forward (which=0) or backward (1) kernel of `backend` (`dispatch` signature)."""
  return _KERNELS[backend][which](layout, interpret, *args, **kwargs)


def frac_scan(x, dt, b, c, rates, weights, initial_state=None, *, interpret=None,
              backend: Backend | None = None, **block_sizes):
  """Chunked multi-mode scan as a Pallas kernel; arguments and result as
  `jaxops.frac.frac_scan_reference`, differentiable in every float input.

  Args:
    x: [Bt, L, H, P]; dt: [Bt, L, H] > 0; b, c: [Bt, L, H, N]; rates, weights: [H, M];
      initial_state: [Bt, H, M, N, P] or None (zeros). Any L.
    interpret: None interprets on CPU and compiles on TPU (Mosaic) and GPU (Triton);
      True (or a `pltpu.InterpretParams`) interprets everywhere; False never interprets.
    backend: force one lowering ("mosaic" or "triton"); with `interpret` this runs that
      kernel body on CPU.
    **block_sizes: overrides of `BlockSizes` fields (chunk).

  Returns:
    (y [Bt, L, H, P] in x.dtype, final state [Bt, H, M, N, P] float32).
  """
  check_scan_inputs(x, dt, b, c, rates, weights, initial_state)
  cfg = KernelConfig.make("frac_scan", BlockSizes, backend=backend, interpret=interpret,
                          block_sizes=block_sizes)
  chunk = cfg.blocks_for(backend or "mosaic").chunk
  if chunk <= 0:
    raise ValueError(f"frac_scan: `chunk` must be positive, got {chunk}")
  state = zero_state(x, b, rates) if initial_state is None else initial_state
  layout = TileLayout.make(x, b, rates, chunk=chunk, pow2=True)
  forward = lambda *a, **kw: dispatch(functools.partial(_run, 0, layout, **kw), cfg, *a)
  backward = lambda *a: dispatch(functools.partial(_run, 1, layout), cfg, *a)
  return scan_vjp(layout, forward, backward)(x, dt, b, c, rates, weights, state)
