"""Byte/char-level decoder LanguageModel with a choice of sequence mixer and FFN.

tokens [B, L] int -> embedding [B, L, d] -> N blocks -> RMSNorm -> head -> logits [B, L, V] (f32).
Block (pre-norm, models.block):  x = x + mixer(RMSNorm(x));  x = x + ffn(RMSNorm(x)).
  mixer: "attention" (causal MHA + 1D RoPE, KV cache), "frac" (FRAC, bounded state),
         "mamba2" (the one-mode exponential layer, FRACMixer(mamba2=True): Mamba-2's decay).
  ffn:   "swiglu" or "flashffn".
`generate` decodes token by token with `init_cache` / `step` (KV cache or recurrent state); its
greedy output equals the argmax of the full forward at each position.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike, DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.models import attention as attention_lib
from neurips26_jax.models.attention import CausalAttention
from neurips26_jax.models.block import FFNS, Block, make_ffn, param_count
from neurips26_jax.models.flash_ffn import swiglu_width
from neurips26_jax.models.impl import Impl, resolve_impl
from neurips26_jax.models.norm import RMSNorm
from neurips26_jax.models.partitioning import constrain, param

MIXERS = ("attention", "frac", "mamba2")


def make_mixer(kind: str, d_model: int, num_heads: int, *, context: int, impl: str,
               interpret: Any, dtype: DTypeLike | None, options: dict[str, Any],
               rngs: nnx.Rngs) -> nnx.Module:
  """The sequence mixer `kind` (one of MIXERS); `options` (a model's `mixer_options`) go to its
  constructor."""
  if kind == "attention":
    checks.options("LanguageModel", "mixer_options", options, CausalAttention,
                   taken=("d_model", "num_heads", "context", "dtype"))
    return CausalAttention(d_model, num_heads, context=context, dtype=dtype, rngs=rngs, **options)
  # lazy: FRAC lives in its own module
  from neurips26_jax.models.frac import FRACMixer  # noqa: PLC0415
  checks.options("LanguageModel", "mixer_options", options, FRACMixer,
                 taken=("d_model", "num_heads", "context", "impl", "interpret", "dtype", "mamba2"))
  return FRACMixer(d_model, num_heads=num_heads, context=context, impl=impl, interpret=interpret,
                   dtype=dtype, mamba2=kind == "mamba2", rngs=rngs, **options)


# What a rematerialised block keeps for its backward besides its input x (`remat`): "full"
# nothing, so the backward runs the whole block's forward again; "mixer" also the sequence
# mixer's core, the values its layer names `MIXER_CORE` (FRAC: the scan's output, end state and
# chunk-start states, `jaxops.frac.CHECKPOINT_NAME`; attention: the heads' outputs before Wo,
# `models.attention.CHECKPOINT_NAME`), so the recomputation skips the scan kernel (the
# attention scores) for about one [B, L, d] more per block (FRAC: plus its chunk-start
# states, M N P float32 per head and chunk).
MIXER_CORE = (frac_ops.CHECKPOINT_NAME, attention_lib.CHECKPOINT_NAME)
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "mixer": jax.checkpoint_policies.save_only_these_names(*MIXER_CORE),
}


def block_call(remat: str, block: Block, x: jax.Array) -> jax.Array:
  """block(x) under a LanguageModel's `remat` ("none", or one of REMAT_POLICIES: its
  activations recomputed in the backward, keeping what the policy names)."""
  if remat == "none":
    return block(x)
  return nnx.remat(lambda block, x: block(x), policy=REMAT_POLICIES[remat])(block, x)


class LanguageModel(nnx.Module):
  """Decoder LM over `vocab_size` tokens (256: bytes).

  Every size below the four required ones has a default, so `LanguageModel(d_model=,
  num_layers=, num_heads=, context=)` builds with any mixer and FFN, and every such model has
  the parameter count of the attention + SwiGLU one within 2% (a tested rule):
    - attention: heads of width d / num_heads.
    - frac, mamba2: num_heads heads of width P = d / num_heads (d_in = d), N = 16
      (see `models.frac.FRACMixer`).
    - FFN: the parameters that a 4 d^2 attention + SwiGLU(d, 8/3 d) block holds, less the
      mixer's: SwiGLU d_ff = that / 3d (a multiple of 8); FlashFFN `flashffn_shape` of it,
      heads of width 128 (`models.flash_ffn.default_head_dim`), not the mixer's.
  Options that set a size override the rule (then no matching is promised).

  Args:
    d_model, num_layers, num_heads: width d, depth N, heads of the mixer.
    context: training length; the attention KV cache and FRAC's memory rates are sized from it.
    mixer, ffn: one of MIXERS, one of FFNS.
    mixer_options, ffn_options: extra constructor arguments, e.g. {"head_dim": 32,
      "state_dim": 16} for FRAC, {"d_ff": 512} for SwiGLU, {"num_heads": 2, "num_experts": 4,
      "d_expert": 64} for FlashFFN.
    impl: kernel choice for FlashFFN / FRAC ("auto", "pallas", "xla", "reference"; see
      `models.impl`); interpret: passed to their kernels.
    remat: recompute each block's activations in the backward (`nnx.remat`). "none" (or
      False): no; "full" (or True): keep only each block's input, memory per block from all
      its activations down to one [B, L, d], for about one more forward of the blocks;
      "mixer": keep the mixer's core output too (`REMAT_POLICIES`), so the recomputation
      skips the FRAC scan or the attention scores, for about one more [B, L, d] per block
      (FRAC: plus its chunk-start states).
    dtype: compute dtype (None: float32); parameters stay float32.

  Token ids must lie in [0, vocab_size): checked when concrete; under jit a
  `checkify.debug_check` (see `jaxops.checks`).
  """

  def __init__(self, *, d_model: int, num_layers: int, num_heads: int, context: int,
               mixer: str = "attention", ffn: str = "swiglu", mixer_options: dict | None = None,
               ffn_options: dict | None = None, impl: Impl = "auto", interpret: Any = None,
               vocab_size: int = 256, remat: bool | str = "none",
               dtype: DTypeLike | None = None, rngs: nnx.Rngs) -> None:
    checks.one_of("LanguageModel", "mixer", mixer, MIXERS)
    checks.one_of("LanguageModel", "ffn", ffn, FFNS)
    impl = resolve_impl("LanguageModel", impl)
    checks.ints("LanguageModel", dict(d_model=d_model, num_layers=num_layers,
                                      num_heads=num_heads, context=context,
                                      vocab_size=vocab_size))
    checks.one_of("LanguageModel", "remat", remat, (False, True, "none", *REMAT_POLICIES))
    remat = {False: "none", True: "full"}.get(remat, remat)
    self.mixer_kind, self.context, self.dtype, self.remat = mixer, context, dtype, remat
    self.embed = param(jax.random.normal(rngs.params(), (vocab_size, d_model)), "vocab", "embed")
    block_params = 4 * d_model**2 + 3 * d_model * swiglu_width(d_model)

    def block():
      mixer_layer = make_mixer(mixer, d_model, num_heads, context=context, impl=impl,
                               interpret=interpret, dtype=dtype,
                               options=dict(mixer_options or {}), rngs=rngs)
      ffn_layer = make_ffn(ffn, d_model, params=block_params - param_count(mixer_layer),
                           impl=impl, interpret=interpret, dtype=dtype,
                           options=dict(ffn_options or {}), rngs=rngs)
      return Block(mixer_layer, ffn_layer, d_model)

    self.blocks = nnx.List([block() for _ in range(num_layers)])
    self.norm = RMSNorm(d_model)
    self.head = param(jax.random.normal(rngs.params(), (d_model, vocab_size)) * d_model ** -0.5,
                      "embed", "vocab")

  def logits(self, features: jax.Array) -> jax.Array:
    """Final features [..., d] (`features`) -> logits [..., V] float32."""
    return jnp.einsum("...d,dv->...v", features, self.head[...].astype(features.dtype),
                      preferred_element_type=jnp.float32)

  def _check_tokens(self, owner: str, name: str, tokens, ndim: int, layout: str):
    checks.shape(owner, name, tokens, (None,) * ndim, layout)
    checks.integer(owner, name, tokens)
    checks.nonempty(owner, name, tokens, layout)
    vocab = self.embed.shape[0]
    checks.values(owner, name, tokens, lambda t: (t >= 0) & (t < vocab),
                  f"hold token ids in [0, vocab_size={vocab})")

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, L] int -> logits [B, L, V] float32."""
    return constrain(self.logits(self.features(tokens)), ("batch", "seq", "act_vocab"))

  def features(self, tokens: jax.Array) -> jax.Array:
    """tokens [B, L] int -> the final normalized features [B, L, d] that `logits` (the
    head, `self.head` [d, V]) reads: a loss over a large vocabulary takes them and computes
    the logits a chunk at a time (`train.losses.chunked_cross_entropy`)."""
    self._check_tokens("LanguageModel", "tokens", tokens, 2, "[B, L]")
    # the table is gathered whole at use (as FSDP gathers every weight): a lookup into a table
    # split over vocab and d has no efficient SPMD lowering (XLA replicates it "involuntarily")
    table = constrain(self.embed[...], (None, None))
    x = constrain(table[tokens].astype(self.dtype or jnp.float32), ("batch", "seq", None))
    for block in self.blocks:
      x = block_call(self.remat, block, x)
    return self.norm(x)

  def init_cache(self, batch: int) -> list[dict[str, jax.Array]]:
    """Per-block decoding caches (KV cache for attention, bounded state for FRAC)."""
    return [block.mixer.init_cache(batch) for block in self.blocks]

  def step(self, token_t: jax.Array,
           cache: list[dict[str, jax.Array]]) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
    """token_t [B] int -> (logits_t [B, V] float32, cache)."""
    self._check_tokens("LanguageModel.step", "token_t", token_t, 1, "[B]")
    x = self.embed[...][token_t].astype(self.dtype or jnp.float32)
    new_cache = []
    for block, c in zip(self.blocks, cache):
      x, c = block.step(x, c)
      new_cache.append(c)
    return self.logits(self.norm(x)), new_cache

  def generate(self, prompt: ArrayLike, num_tokens: int, *, temperature: float = 0.0,
               seed: int = 0) -> jax.Array:
    """Continue `prompt` [B, P] int by `num_tokens` tokens, one at a time -> [B, P + num_tokens].

    The prompt is fed through `step` too (recurrent prefill). temperature 0 is greedy (argmax).
    """
    self._check_tokens("LanguageModel.generate", "prompt", jnp.asarray(prompt), 2, "[B, P]")
    checks.ints("LanguageModel.generate", {"num_tokens": num_tokens}, minimum=0)
    prompt = jnp.asarray(prompt, jnp.int32)
    total = prompt.shape[1] + num_tokens
    if self.mixer_kind == "attention" and total > self.context:
      raise ValueError(f"generate: prompt + num_tokens = {total} exceeds the attention KV cache "
                       f"(context={self.context})")
    graphdef, state = nnx.split(self)
    return _generate(graphdef, state, prompt, num_tokens, jnp.float32(temperature),
                     jax.random.key(seed))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(graphdef, state, prompt, num_tokens, temperature, key):
  model = nnx.merge(graphdef, state)
  batch, plen = prompt.shape
  tokens = jnp.zeros((batch, plen + num_tokens), jnp.int32).at[:, :plen].set(prompt)

  def body(carry, t):
    tokens, cache = carry
    logits, cache = model.step(tokens[:, t], cache)
    sampled = jax.random.categorical(jax.random.fold_in(key, t),
                                     logits / jnp.maximum(temperature, 1e-6))
    nxt = jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
    nxt = jnp.where(t + 1 < plen, tokens[:, t + 1], nxt)
    return (tokens.at[:, t + 1].set(nxt), cache), None

  (tokens, _), _ = jax.lax.scan(body, (tokens, model.init_cache(batch)),
                                jnp.arange(plen + num_tokens - 1))
  return tokens
