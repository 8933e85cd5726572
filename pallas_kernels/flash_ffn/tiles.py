"""FlashFFN tile math and tile plan, shared by the Mosaic and Triton kernels.

For one head, a tile of `bq` tokens q [bq, d_h] and one (expert e, d_e tile) of `bi`
rows of the tables K, U, V [bi, d_h]:

  m = q K^T ,  n = q U^T ,  a = silu(m) * n          [bq, bi]
  o += (r_e a) V                                     [bq, d_h]

Backward, recomputing m, n from (q, r, K, U, V) and the output cotangent ds:

  da = ds V^T ;  dr_e = rowsum(da * a)
  dm = r_e da n silu'(m) ;  dn = r_e da silu(m)       silu'(x) = sig(x)(1 + x(1 - sig(x)))
  dq += dm K + dn U                                  (kernel over token tiles)
  dK += dm^T q ;  dU += dn^T q ;  dV += (r_e a)^T ds  (kernel over (e, d_e tile))

`Orientation` computes each tile either way round ([bq, bi] or its transpose, see there):
Mosaic keeps tokens on the lane axis so the router can stay lane-dense.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from neurips26_jax.jaxops.tiling import dot, dot_nt, dot_tn, next_pow2, round_up
from neurips26_jax.pallas_kernels.dispatch import BLACKWELL, HOPPER, Backend
from neurips26_jax.pallas_kernels.flash_ffn.blocks import BlockSizes, mosaic_vmem_limit
from neurips26_jax.pallas_kernels.mosaic_gpu_common import blackwell

_F32 = jnp.float32


def tanh_sigmoid(x):
  """sigmoid(x) = (1 + tanh(x / 2)) / 2: exact, and one transcendental per element where
  jax.nn.sigmoid lowers to an exp and a reciprocal (the TPU kernels' VPU/EUP budget)."""
  return 0.5 + 0.5 * jnp.tanh(0.5 * x)


def weighted_activation(m, n, r_e, sigmoid=jax.nn.sigmoid):
  """r_e silu(m) n: one tile's weighted activation from its gate and up scores, float32."""
  return m * sigmoid(m) * n * r_e


def activation_grads(m, n, da, r_e, sigmoid=jax.nn.sigmoid):
  """(a, dm, dn) of one tile from its scores m, n and the activation's cotangent da, float32.

  a = silu(m) n is unweighted (dr_e = rowsum(da a)); dm and dn include the weight r_e."""
  sig = sigmoid(m)
  silu = m * sig
  g = r_e * da
  return silu * n, g * n * sig * (1.0 + m * (1.0 - sig)), g * silu


@dataclasses.dataclass(frozen=True)
class Orientation:
  """Which way round a tile is computed.

  transposed=True (Mosaic): tiles are [bi, bq] with tokens on the lane axis and the
  router block is [E, bq]; its row e broadcasts over a tile, and the router can live as
  [H, E, T] in HBM (a TPU pads the minor dim to 128 lanes, so [T, H, E] with E=11 would
  take 11.6x its size).
  transposed=False (Triton): tiles are [bq, bi], the router block is [bq, E] and its column
  e broadcasts. GPUs do not pad, and this way no register value is ever transposed (each
  transpose costs a round trip through shared memory and registers in Triton).
  """

  transposed: bool

  def scores(self, x, w):
    """Tile of x w^T: x [bq, d] tokens, w [bi, d] table rows."""
    return dot_nt(w, x) if self.transposed else dot_nt(x, w)

  def to_tokens(self, a, w):
    """a^T w (transposed) or a w: tile [.., ..], w [bi, d] -> [bq, d]."""
    return dot_tn(a, w) if self.transposed else dot(a, w)

  def to_table(self, a, x):
    """a x (transposed) or a^T x: tile, x [bq, d] -> [bi, d]."""
    return dot(a, x) if self.transposed else dot_tn(a, x)

  def per_token_sum(self, a):
    """Sum over the table axis of a tile, keeping the router block's token orientation."""
    return jnp.sum(a, axis=0 if self.transposed else 1, keepdims=True)

  def _expert_axis(self):
    return 0 if self.transposed else 1

  def router_weights(self, r, e):
    """Weights of expert e from a router block r ([E, bq] or [bq, E]) as a float32 row
    [1, bq] or column [bq, 1], for a traced e (a masked sum: lowers in Mosaic and Triton)."""
    ids = jax.lax.broadcasted_iota(jnp.int32, r.shape, self._expert_axis())
    return jnp.sum(jnp.where(ids == e, r.astype(_F32), 0.0), axis=self._expert_axis(),
                   keepdims=True)

  def onehot(self, e, shape):
    """A float32 router-block mask selecting expert e."""
    return (jax.lax.broadcasted_iota(jnp.int32, shape, self._expert_axis()) == e).astype(_F32)

  # The tile math itself.

  def forward(self, q, r_e, k, u, v):
    """One (expert, d_e tile)'s contribution to the output, [bq, d_h] float32."""
    a = weighted_activation(self.scores(q, k), self.scores(q, u), r_e)
    return self.to_tokens(a.astype(v.dtype), v)

  def _recompute(self, q, r_e, ds, k, u, v):
    """(a, da, dm, dn) of one tile, float32."""
    da = self.scores(ds, v)
    a, dm, dn = activation_grads(self.scores(q, k), self.scores(q, u), da, r_e)
    return a, da, dm, dn

  def dq_dr(self, q, r_e, ds, k, u, v):
    """(dq [bq, d_h], dr_e per token) of one (expert, d_e tile), float32."""
    a, da, dm, dn = self._recompute(q, r_e, ds, k, u, v)
    dq = self.to_tokens(dm.astype(k.dtype), k) + self.to_tokens(dn.astype(u.dtype), u)
    return dq, self.per_token_sum(da * a)

  def dkuv(self, q, r_e, ds, k, u, v):
    """(dK, dU, dV) [bi, d_h] float32 of one token tile."""
    a, _, dm, dn = self._recompute(q, r_e, ds, k, u, v)
    return (self.to_table(dm.astype(q.dtype), q), self.to_table(dn.astype(q.dtype), q),
            self.to_table((r_e * a).astype(ds.dtype), ds))


# ----------------------------------------------------------------------------
# The tile plan: fitted tile sizes, padded extents and array layouts. Token arrays
# (q, ds, o, dq) are "flat" [T, H * d_h], a free reshape of [B, L, H, d_h] whose blocks
# are (tokens, d_h) at column block h, where that block is legal (Mosaic: d_h % 128 == 0;
# Triton: d_h a power of two; Mosaic GPU: d_h unpadded), else head-major [H, T, d_h]. The
# router is [H, E, T] (Mosaic, Mosaic GPU) or [H, T, E_pad] (Triton). `orient` is the
# orientation of the Mosaic and Triton tiles and, for every backend, of the router
# (Mosaic GPU computes [tokens, rows] tiles from a tokens-last router).
# Tables stay [H, E, d_e, d_h]. Inside the kernels every block is 2-D.
# ----------------------------------------------------------------------------

# tcgen05's M in the Blackwell kernels. Mosaic GPU also has M = 64, but its tensor-memory
# layout (the columns split over two lane halves) wants 16-column multiples and, in jax
# 0.12, has no register layout that these kernels' row broadcasts lower to.
_BLACKWELL_M = 128
# The widest (padded) head the Mosaic GPU kernels take, per generation. Hopper: d_h is a
# WGMMA N, at most 256. Blackwell: the dK/dU/dV kernel keeps four [128, d_h] tiles (K, U, V
# and its output staging) in shared memory, 227 KiB a block (d_h = 192: 265 KiB).
MAX_D_H = {HOPPER: 256, BLACKWELL: 128}


def padded_d_h(backend: Backend, d_h: int, dtype) -> int:
  """d_h as the kernels of `backend` see it: Triton a power of two; Mosaic GPU a multiple of
  32 bytes (a shared-memory minor dim); Mosaic unpadded."""
  if backend == "triton":
    return next_pow2(d_h)
  if backend == "mosaic_gpu":
    return round_up(d_h, 32 // jnp.dtype(dtype).itemsize)
  return d_h


def mosaic_gpu_generations(d_h: int, dtype) -> tuple:
  """The generations (compute-capability majors) whose Mosaic GPU kernels take heads d_h wide
  in `dtype`: what `backend=None` may pick; wider heads take Triton there."""
  width = padded_d_h("mosaic_gpu", d_h, dtype)
  return tuple(g for g, limit in MAX_D_H.items() if width <= limit)


def _fit_tokens(backend: Backend, name: str, block: int, tokens: int) -> int:
  if backend == "mosaic_gpu":  # WGMMA: M a multiple of 64 (block_q); N, K of 16 (block_q_dkv)
    if name == "block_q" and blackwell():  # exactly tcgen05's M, however few the tokens
      if block != _BLACKWELL_M:
        raise ValueError(f"mhffn: Mosaic GPU block size `block_q` must be {_BLACKWELL_M} on "
                         f"Blackwell (tcgen05's M: one accumulator row per tensor-memory "
                         f"lane), got {block}")
      return block
    multiple = 64 if name == "block_q" else 16
    if block % multiple:
      raise ValueError(f"mhffn: Mosaic GPU block size `{name}` must be a multiple of "
                       f"{multiple}, got {block}")
    return min(block, round_up(tokens, multiple))
  if backend == "triton":  # power-of-two tiles, >= 16 for tl.dot
    if block & (block - 1) or block < 16:
      raise ValueError(f"mhffn: Triton block size `{name}` must be a power of two >= 16, "
                       f"got {block}")
    return min(block, next_pow2(tokens))
  if block % 128:
    raise ValueError(f"mhffn: Mosaic block size `{name}` must be a multiple of 128 (tokens "
                     f"are the router block's lane axis), got {block}")
  return min(block, round_up(tokens, 128))


# The warp-specialized Hopper kernels' widest head: a consumer of the dK/dU/dV kernel holds
# two [64, d_h] float32 sums, 2 d_h / 2 registers per thread of its 232.
WS_MAX_D_H = 128


def mosaic_table_tile(d_e: int, block: int, itemsize: int) -> int:
  """The Mosaic kernels' d_e tile: d_e in the fewest tiles of at most `block` rows, so that
  d_e pads by less than a tile: d_e = 264 takes 2 tiles of 144 (288 rows) where tiles of
  256 would pad it to 512 and double the work. One tile is d_e rounded up to 8 rows; several
  are rounded up to whole sublane rows of the compute dtype (8 for 4-byte, 16 for 2-byte
  values: the tiles after the first start at multiples of it). `block` caps either."""
  tiles = -(-d_e // block)
  if tiles == 1:
    return min(block, round_up(d_e, 8))
  return min(block, round_up(-(-d_e // tiles), 8 * max(1, 4 // itemsize)))


def mosaic_vmem_bytes(experts: int, d_e: int, d_h: int, itemsize: int, bq: int, bk: int,
                      bi: int, table_itemsize: int | None = None) -> int:
  """VMEM the larger Mosaic kernel (the backward) needs with `experts` experts per step.

  Double-buffered blocks: the three tables and their gradients ([experts, d_e, d_h] each, in
  the tables' dtype, `table_itemsize`, None: q's), q, ds, dq and the router and dr blocks;
  the routed kernels' copy of the tables in q's dtype (`mosaic._stage_tables`, counted
  always); float32 scratch: the gradient accumulators and about ten [bk, bi] tiles of
  intermediates (scores, activation, their casts). The forward holds the tables, their copy
  and fewer, [bq, bi] tiles.
  """
  tables = 3 * experts * d_e * d_h
  stored = itemsize if table_itemsize is None else table_itemsize
  tokens = 3 * bk * d_h * itemsize + 2 * round_up(experts, 8) * bk * 4
  backward = (4 * tables * stored + tables * itemsize + 4 * tables + 2 * tokens
              + 10 * bk * bi * 4 + 3 * bk * d_h * 4)
  forward = tables * (2 * stored + itemsize) + 4 * bq * d_h * itemsize + 6 * bq * bi * 4
  return max(backward, forward)


def mosaic_experts_per_step(experts: int, d_e: int, d_h: int, itemsize: int, bq: int, bk: int,
                            bi: int, table_itemsize: int | None = None) -> int:
  """E if a head's tables fit the chip's VMEM budget (`blocks.mosaic_vmem_limit`), else the
  largest multiple of 8 (a router block's sublane rows) that fits, at least 8."""
  budget = mosaic_vmem_limit()
  size = lambda group: mosaic_vmem_bytes(group, d_e, d_h, itemsize, bq, bk, bi, table_itemsize)
  if experts <= 8 or size(experts) <= budget:
    return experts
  group = 8
  while group + 8 < experts and size(group + 8) <= budget:
    group += 8
  return group


@dataclasses.dataclass(frozen=True)
class TilePlan:
  """Fitted tile sizes, padded extents and token layout for one backend and problem."""

  blocks: BlockSizes
  heads: int
  tokens: int        # padded to a multiple of both token tiles
  d_h: int           # padded (Triton: a power of two; Mosaic GPU: a multiple of 32 bytes)
  experts: int       # the real E (the reduction runs over these only)
  experts_pad: int   # rows of the router array (Triton: a power of two)
  d_e: int           # padded to a multiple of block_inter and rows_dkuv
  rows_dkuv: int     # table rows per dK/dU/dV program (block_inter; Mosaic GPU: >= 64 on
                     # Hopper, exactly 128 on Blackwell)
  experts_per_step: int  # Mosaic: the experts whose tables one grid step holds (all of
                         # them, or a multiple of 8); the other backends: E
  flat: bool
  orient: Orientation        # forward and dq kernels
  orient_dkuv: Orientation   # dK/dU/dV kernel

  @classmethod
  def make(cls, backend: Backend, blocks: BlockSizes, q, k) -> "TilePlan":
    batch, length, heads, d_h = q.shape
    experts, d_e = k.shape[1:3]
    tokens = batch * length
    bq = _fit_tokens(backend, "block_q", blocks.block_q, tokens)
    bk = _fit_tokens(backend, "block_q_dkv", blocks.block_q_dkv, tokens)
    if backend == "triton":
      bi = min(blocks.block_inter, next_pow2(d_e))
      if bi & (bi - 1):
        raise ValueError(f"mhffn: Triton block size `block_inter` must be a power of two, "
                         f"got {blocks.block_inter}")
      width, experts_pad = padded_d_h(backend, d_h, q.dtype), next_pow2(experts, minimum=1)
      flat = width == d_h
    elif backend == "mosaic_gpu":
      # block_inter is an N and a K of WGMMA in the forward and dq kernels; the dK/dU/dV
      # kernel's table rows are its M, a multiple of 64 (`rows_dkuv`). d_h is a K and an N
      # and a shared-memory minor dim (`padded_d_h`), at most the generation's MAX_D_H.
      # Blackwell: the rows are exactly tcgen05's M, 128 (block_inter at most 128).
      bi, rows = blocks.block_inter, _BLACKWELL_M if blackwell() else 64
      if (bi % 16 or (bi < 64 and 64 % bi) or (bi > 64 and bi % 64)
          or (blackwell() and rows % bi)):
        raise ValueError(f"mhffn: Mosaic GPU block size `block_inter` must be 16, 32 or a "
                         f"multiple of 64 (at most {_BLACKWELL_M} on Blackwell), got {bi}")
      bi = min(bi, round_up(d_e, rows))
      rows_dkuv = max(bi, rows)
      width = padded_d_h(backend, d_h, q.dtype)
      limit = MAX_D_H[BLACKWELL if blackwell() else HOPPER]
      if width > limit:
        raise ValueError(f"mhffn: the Mosaic GPU kernel needs d_h <= {limit}"
                         f"{' on Blackwell' if blackwell() else ''}, got {d_h}")
      experts_pad, flat = experts, width == d_h
      if blocks.compute_wgs not in (1, 2):
        raise ValueError(f"mhffn: Mosaic GPU block size `compute_wgs` must be 1 or 2, got "
                         f"{blocks.compute_wgs}")
      if blocks.compute_wgs == 2 and (blackwell() or jnp.dtype(q.dtype).itemsize != 2
                                      or width > WS_MAX_D_H):
        raise ValueError("mhffn: `compute_wgs=2` (the warp-specialized kernels) needs 16-bit "
                         f"inputs on Hopper and d_h <= {WS_MAX_D_H} (two [64, d_h] float32 "
                         f"sums per consumer), got {jnp.dtype(q.dtype).name}, d_h = {d_h}"
                         f"{' on Blackwell' if blackwell() else ''}")
      if blocks.compute_wgs == 2 and blocks.num_stages < 2:
        raise ValueError(f"mhffn: `compute_wgs=2` needs `num_stages` >= 2 (a consumer releases "
                         f"a step's slot one step late), got {blocks.num_stages}")
    else:
      if blocks.block_inter % 8:
        raise ValueError(f"mhffn: Mosaic block size `block_inter` must be a multiple of 8, "
                         f"got {blocks.block_inter}")
      bi = mosaic_table_tile(d_e, blocks.block_inter, jnp.dtype(q.dtype).itemsize)
      width, flat = padded_d_h(backend, d_h, q.dtype), d_h % 128 == 0 or heads == 1
      group = mosaic_experts_per_step(experts, round_up(d_e, bi), width,
                                      jnp.dtype(q.dtype).itemsize, bq, bk, bi,
                                      jnp.dtype(k.dtype).itemsize)
      experts_pad = round_up(experts, group)
    if backend != "mosaic":
      group = experts
    if backend != "mosaic_gpu":
      rows_dkuv = bi
    tile = max(bq, bk)
    if tile % bq or tile % bk:
      raise ValueError(f"mhffn: block_q ({bq}) and block_q_dkv ({bk}) must divide one another")
    if backend == "mosaic_gpu":  # a warp-specialized CTA holds compute_wgs token tiles
      tile = math.lcm(tile, bq * blocks.compute_wgs)
    return cls(dataclasses.replace(blocks, block_q=bq, block_inter=bi, block_q_dkv=bk), heads,
               round_up(tokens, tile), width, experts, experts_pad,
               round_up(d_e, rows_dkuv), rows_dkuv, group, flat,
               Orientation(transposed=backend != "triton"), Orientation(transposed=True))

  # Array layout in and out of the kernels.

  def tokens_in(self, x):
    """q-like [B, L, H, d_h] -> kernel layout, zero-padded."""
    b, l, h, width = x.shape
    x = jnp.pad(x.reshape(b * l, h, width),
                ((0, self.tokens - b * l), (0, 0), (0, self.d_h - width)))
    return x.reshape(self.tokens, -1) if self.flat else jnp.moveaxis(x, 1, 0)

  def tokens_out(self, x, like):
    b, l, h, width = like.shape
    x = x.reshape(self.tokens, h, self.d_h) if self.flat else jnp.moveaxis(x, 0, 1)
    return x[:b * l, :, :width].reshape(like.shape)

  @staticmethod
  def router_t(r):
    """r [B, L, H, E] -> float32 [H, E, T] (tokens last): the form kept for the backward."""
    return jnp.transpose(r.reshape(-1, *r.shape[2:]), (1, 2, 0)).astype(_F32)

  def router_in(self, r_t, orient: Orientation):
    """[H, E, T] -> kernel layout: [H, E_pad, T_pad] or [H, T_pad, E_pad], zero-padded."""
    r = jnp.pad(r_t, ((0, 0), (0, self.experts_pad - r_t.shape[1]),
                      (0, self.tokens - r_t.shape[2])))
    return r if orient.transposed else jnp.swapaxes(r, 1, 2)

  def router_out(self, dr, shape):
    """Kernel-layout dr -> [B, L, H, E]."""
    b, l, h, e = shape
    dr = dr if self.orient.transposed else jnp.swapaxes(dr, 1, 2)
    return jnp.transpose(dr[:, :e, :b * l], (2, 0, 1)).reshape(shape)

  @property
  def table_experts(self) -> int:
    """Experts of the tables as the kernels see them: E padded to whole expert groups."""
    return round_up(self.experts, self.experts_per_step)

  @property
  def groups(self) -> int:
    """Mosaic: expert groups (grid steps) per (head, token tile); 1 when a head's tables
    fit in VMEM."""
    return self.table_experts // self.experts_per_step

  def table_in(self, t):
    return jnp.pad(t, ((0, 0), (0, self.table_experts - t.shape[1]),
                       (0, self.d_e - t.shape[2]), (0, self.d_h - t.shape[3])))

  @staticmethod
  def table_out(t, like):
    return t[:, :like.shape[1], :like.shape[2], :like.shape[3]]

  def token_shape(self, dtype):
    shape = ((self.tokens, self.heads * self.d_h) if self.flat
             else (self.heads, self.tokens, self.d_h))
    return jax.ShapeDtypeStruct(shape, dtype)

  def router_shape(self):
    """dr from the dq kernel."""
    rows = (self.experts_pad, self.tokens)
    return jax.ShapeDtypeStruct((self.heads, *(rows if self.orient.transposed else rows[::-1])),
                                _F32)

  def table_shape(self, dtype):
    return jax.ShapeDtypeStruct((self.heads, self.table_experts, self.d_e, self.d_h), dtype)

  # Block specs; `where(*grid) -> (h, i)` or `(h, e, c)` picks the block.

  def token_spec(self, rows: int, where):
    if self.flat:
      return pl.BlockSpec((rows, self.d_h), lambda *g: where(*g)[::-1])
    return pl.BlockSpec((None, rows, self.d_h), lambda *g: (*where(*g), 0))

  def router_spec(self, tokens: int, where, orient: Orientation):
    if orient.transposed:
      return pl.BlockSpec((None, self.experts_pad, tokens),
                          lambda *g: (where(*g)[0], 0, where(*g)[1]))
    return pl.BlockSpec((None, tokens, self.experts_pad), lambda *g: (*where(*g), 0))

  def table_spec(self, rows: int, where):
    return pl.BlockSpec((None, None, rows, self.d_h), lambda *g: (*where(*g), 0))
