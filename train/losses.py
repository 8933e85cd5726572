"""The one masked loss every task uses."""

from __future__ import annotations

import jax.numpy as jnp
import optax


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
