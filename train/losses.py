"""The one masked loss every task uses, and its chunked form for large vocabularies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from neurips26_jax.jaxops.tiling import seq_chunks

# Logit elements per batch row that `chunked_cross_entropy` computes at once by default:
# 2^25 float32 = 128 MiB (1,024 positions of a 32k vocabulary; a 256-byte vocabulary's whole
# 131k-token row).
LOGIT_ELEMENTS = 2**25


def _per_position(logits, labels):
  """(cross entropy, 1.0 where the argmax is the label), each [...] float32."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return ce, (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def masked_cross_entropy(logits, labels, mask=None):
  """logits [..., K] float, labels int [...], mask [...] in [0, 1] (None: all ones) ->
  (mean cross entropy over the masked positions, their accuracy), both float32 scalars.
  An all-zero mask gives 0 and 0 (the count is floored at 1), not NaN."""
  ce, correct = _per_position(logits, labels)
  if mask is None:
    return ce.mean(), correct.mean()
  count = jnp.maximum(mask.sum(), 1.0)
  return (ce * mask).sum() / count, (correct * mask).sum() / count


def default_chunk(vocab: int) -> int:
  """Positions per chunk: LOGIT_ELEMENTS // vocab, at least 128."""
  return max(128, LOGIT_ELEMENTS // vocab)


def chunked_cross_entropy(features, logits_of, labels, mask=None, *, chunk: int | None = None):
  """`masked_cross_entropy(logits_of(features), labels, mask)` without the whole logits.

  features [B, L, d] (the model's final features), logits_of: features [..., d] -> logits
  [..., V] (the model's head, e.g. `LanguageModel.logits`), labels int [B, L], mask [B, L] or
  None -> (mean cross entropy over the masked positions, their accuracy). The logits [B,
  chunk, V] are computed `chunk` positions at a time (None: `default_chunk(V)`) and
  recomputed in the backward, so neither they nor their gradient is ever held for all L
  positions: at L = 32k and V = 32k that is 4 GiB per batch row twice (float32 logits and
  their gradient), against 2 x 128 MiB. A chunk >= L is the plain loss.
  """
  batch, length, _ = features.shape
  vocab = jax.eval_shape(logits_of, features[:, :1]).shape[-1]
  chunk = min(length, default_chunk(vocab) if chunk is None else chunk)
  if chunk >= length:
    return masked_cross_entropy(logits_of(features), labels, mask)
  mask = jnp.ones((batch, length), jnp.float32) if mask is None else mask.astype(jnp.float32)

  @jax.checkpoint
  def step(sums, xs):
    x, y, m = xs
    ce, correct = _per_position(logits_of(x), y)
    return (sums[0] + (ce * m).sum(), sums[1] + (correct * m).sum()), None

  zero = jnp.zeros((), jnp.float32)
  # The padded positions of the last chunk have mask 0.
  (ce, correct), _ = jax.lax.scan(step, (zero, zero), tuple(
      seq_chunks(x, chunk) for x in (features, labels, mask)))
  count = jnp.maximum(mask.sum(), 1.0)
  return ce / count, correct / count
