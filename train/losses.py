"""The one masked loss every task uses, and its chunked form for large vocabularies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

# Logit elements per batch row that `chunked_cross_entropy` computes at once by default:
# 2^25 float32 = 128 MiB (1,024 positions of a 32k vocabulary; a 256-byte vocabulary's whole
# 131k-token row).
LOGIT_ELEMENTS = 2**25


def masked_cross_entropy(logits, labels, mask=None):
  """logits [..., K] float, labels int [...], mask [...] in [0, 1] (None: all ones) ->
  (mean cross entropy over the masked positions, their accuracy), both float32 scalars.
  An all-zero mask gives 0 and 0 (the count is floored at 1), not NaN."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
  if mask is None:
    return ce.mean(), correct.mean()
  count = jnp.maximum(mask.sum(), 1.0)
  return (ce * mask).sum() / count, (correct * mask).sum() / count


def default_chunk(vocab: int) -> int:
  """Positions per chunk: LOGIT_ELEMENTS // vocab, at least 128."""
  return max(128, LOGIT_ELEMENTS // vocab)


def chunked_cross_entropy(features, head, labels, mask=None, *, chunk: int | None = None):
  """`masked_cross_entropy(features @ head, labels, mask)` without the whole logits.

  features [B, L, d] (the final normalized features), head [d, V], labels int [B, L], mask
  [B, L] or None -> (mean cross entropy over the masked positions, their accuracy). The
  float32 logits [B, chunk, V] are computed `chunk` positions at a time (None:
  `default_chunk(V)`) and recomputed in the backward, so neither they nor their gradient is
  ever held for all L positions: at L = 32k and V = 32k that is 4 GiB per batch row twice
  (logits and their gradient), against 2 x 128 MiB. A chunk >= L is the plain loss.
  """
  batch, length, _ = features.shape
  chunk = min(length, default_chunk(head.shape[1]) if chunk is None else chunk)
  logits_of = lambda x: jnp.einsum("...d,dv->...v", x, head.astype(x.dtype),
                                   preferred_element_type=jnp.float32)
  if chunk >= length:
    return masked_cross_entropy(logits_of(features), labels, mask)
  mask = jnp.ones((batch, length), jnp.float32) if mask is None else mask.astype(jnp.float32)
  steps = -(-length // chunk)
  pad = steps * chunk - length

  def chunks(x):  # [B, L, ...] -> [steps, B, chunk, ...], padded positions masked out
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(batch, steps, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def step(sums, xs):
    x, y, m = xs
    logits = logits_of(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
    return (sums[0] + (ce * m).sum(), sums[1] + (correct * m).sum()), None

  zero = jnp.zeros((), jnp.float32)
  (ce, correct), _ = jax.lax.scan(step, (zero, zero),
                                  (chunks(features), chunks(labels), chunks(mask)))
  count = jnp.maximum(mask.sum(), 1.0)
  return ce / count, correct / count
