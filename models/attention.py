"""Causal multi-head self-attention with 1D RoPE, for full sequences and KV-cache decoding.

Shapes: x [B, L, d]; H heads of width D = d / H (D even).
  q, k, v = x Wq, x Wk, x Wv                      [B, L, H, D]
  q, k    = RoPE(q, t), RoPE(k, t), t = 0..L-1     jaxops.rope.rope_1d
  o       = softmax(q k^T / sqrt(D) + causal mask) v, float32 logits and softmax
  y       = o Wo                                   [B, L, d]
Decoding keeps k, v for `context` positions: cache {"k", "v": [B, context, H, D], "pos": int32}.

Memory: a long sequence is attended `query_chunk` queries at a time, each chunk under
`jax.checkpoint`, so the float32 [B, H, chunk, L] scores of one chunk are live at once and the
backward recomputes them: O(chunk L) instead of O(L^2) per layer. The chunks come in up to
`KEY_GROUPS` static groups that attend only the keys before their group's end, so most of
the masked causal half is never computed (56% of the dense form's score work at 8 groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.rope import rope_1d
from neurips26_jax.jaxops.tiling import seq_chunks, seq_unchunk
from neurips26_jax.models.partitioning import constrain, param


def _softmax_attention(q, k, v, mask):
  """softmax(q k^T / sqrt(D), masked) v with float32 scores: q [B, Lq, H, D], k, v [B, Lk, H,
  D], mask [Lq, Lk] (True = keep) -> [B, Lq, H, D] in v's dtype."""
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
  logits = jnp.where(mask, logits * q.shape[-1] ** -0.5, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


# The name (`jax.ad_checkpoint.checkpoint_name`) of the heads' outputs o before Wo: a remat
# policy that saves it keeps the attention scores out of the block's recomputation (the
# backward still recomputes each query chunk's scores: `jax.checkpoint` per chunk).
CHECKPOINT_NAME = "attention"


# Float32 score elements per sequence that one query chunk may hold: 2^25 = 128 MiB.
SCORE_ELEMENTS = 2**25
# Static groups of query chunks, each attending the keys up to its last query: G groups do
# (G + 1) / 2G of the full rectangle's score work (8: 56%; the causal half is 50%).
KEY_GROUPS = 8


def default_query_chunk(num_heads: int, length: int) -> int:
  """Queries per chunk: the largest power of two with H x chunk x L <= SCORE_ELEMENTS, at
  least 64 (L = 4096, H = 12: 512; L = 32768: 64)."""
  chunk = 64
  while num_heads * 2 * chunk * length <= SCORE_ELEMENTS:
    chunk *= 2
  return chunk


def causal_heads(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
  """The heads' causal outputs o [B, L, H, D] (v's dtype) from q, k, v [B, L, H, D] (RoPE'd),
  `chunk` queries at a time (`default_query_chunk`), each chunk under `jax.checkpoint`."""
  length = q.shape[1]
  if length <= chunk:
    return _softmax_attention(q, k, v, jnp.tril(jnp.ones((length, length), bool)))
  # The chunks come in at most KEY_GROUPS groups; a group's chunks attend only the keys up
  # to the group's last query (a static slice), skipping most of the masked causal half.
  # Padded queries (past a group's end) see every key, so no row is all -inf; dropped.
  chunks = -(-length // chunk)
  per_group = -(-chunks // min(chunks, KEY_GROUPS))
  outs = []
  for first in range(0, chunks, per_group):
    start, stop = first * chunk, min(length, (first + per_group) * chunk)
    k_g, v_g, keys = k[:, :stop], v[:, :stop], jnp.arange(stop)

    @jax.checkpoint
    def one_chunk(args, k_g=k_g, v_g=v_g, keys=keys):
      q_c, offset = args
      return _softmax_attention(q_c, k_g, v_g, (offset + jnp.arange(chunk))[:, None] >= keys)

    q_g = seq_chunks(q[:, start:stop], chunk)
    o = jax.lax.map(one_chunk, (q_g, start + jnp.arange(q_g.shape[0]) * chunk))
    outs.append(seq_unchunk(o, stop - start))
  return jnp.concatenate(outs, axis=1)


class CausalAttention(nnx.Module):
  """Causal MHA with RoPE; `context` is the longest sequence `step` can decode.

  x [B, L, d] -> [B, L, d] (`__call__`); x_t [B, d] -> [B, d] with a KV cache (`step`).
  No kernel (no `impl`): XLA attention, O(L^2) FLOPs, O(query_chunk L) memory.

  Args:
    d_model, num_heads: d and H (d % H == 0, d / H even).
    context: KV-cache length for decoding.
    query_chunk: queries attended at once when L exceeds it (None: `default_query_chunk`,
      the scores of a chunk about 128 MiB of float32 per sequence).
    dtype: compute dtype (None: the input's); parameters stay `param_dtype`.
  """

  def __init__(self, d_model: int, num_heads: int, *, context: int, rope_theta: float = 10000.0,
               query_chunk: int | None = None, dtype: DTypeLike | None = None,
               param_dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs) -> None:
    checks.ints("CausalAttention", dict(d_model=d_model, num_heads=num_heads, context=context,
                                        **checks.given(query_chunk=query_chunk)))
    checks.multiple("CausalAttention", "`d_model`", d_model, 2 * num_heads, "2 * `num_heads`"
                    " (an even head width)")
    d_h = d_model // num_heads
    self.num_heads, self.context, self.theta, self.dtype = num_heads, context, rope_theta, dtype
    self.query_chunk = query_chunk
    init = jax.nn.initializers.normal(d_model ** -0.5)
    self.wq, self.wk, self.wv = (param(init(rngs.params(), (d_model, num_heads, d_h), param_dtype),
                                       "embed", "heads", None) for _ in range(3))
    self.wo = param(init(rngs.params(), (num_heads, d_h, d_model), param_dtype),
                    "heads", None, "embed")

  def _qkv(self, x, positions):
    dtype = self.dtype or x.dtype
    x = x.astype(dtype)
    q, k, v = (jnp.einsum("bld,dhk->blhk", x, w[...].astype(dtype))
               for w in (self.wq, self.wk, self.wv))
    positions = jnp.broadcast_to(positions, x.shape[:2])
    return rope_1d(q, positions, theta=self.theta), rope_1d(k, positions, theta=self.theta), v

  def _out(self, o):
    """Heads' outputs [B, L, H, D] -> y = o Wo [B, L, d]."""
    o = constrain(o, ("batch", "seq", "act_heads", None))
    return jnp.einsum("bqhd,hdm->bqm", o, self.wo[...].astype(o.dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    """x [B, L, d] -> [B, L, d]."""
    checks.sequence("CausalAttention", "x", x, self.wo.shape[-1])
    q, k, v = self._qkv(x, jnp.arange(x.shape[1]))
    q, k, v = (constrain(t, ("batch", "seq", "act_heads", None)) for t in (q, k, v))
    chunk = self.query_chunk or default_query_chunk(self.num_heads, x.shape[1])
    return self._out(checkpoint_name(causal_heads(q, k, v, chunk), CHECKPOINT_NAME))

  def init_cache(self, batch: int) -> dict[str, jax.Array]:
    """{"k", "v": [batch, context, H, D] zeros, "pos": 0}."""
    checks.ints("CausalAttention.init_cache", {"batch": batch})
    d_h = self.wq.shape[-1]
    zeros = jnp.zeros((batch, self.context, self.num_heads, d_h), self.dtype or jnp.float32)
    return {"k": zeros, "v": zeros, "pos": jnp.zeros((), jnp.int32)}

  def step(self, x_t: jax.Array,
           cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One token: x_t [B, d] at position cache["pos"] (< context) -> (y_t [B, d], cache)."""
    d_model = self.wo.shape[-1]
    checks.shape("CausalAttention.step", "x_t", x_t, (None, d_model), f"[B, d_model={d_model}]")
    pos = cache["pos"]
    checks.values("CausalAttention.step", "cache['pos']", pos, lambda p: p < self.context,
                  f"be < context={self.context} (the KV cache is full)")
    q, k, v = self._qkv(x_t[:, None], pos[None])
    k_all = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), pos, 1)
    v_all = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), pos, 1)
    mask = (jnp.arange(self.context) <= pos)[None]
    y = self._out(_softmax_attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask))
    return y[:, 0], {"k": k_all, "v": v_all, "pos": pos + 1}
