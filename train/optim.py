"""The optimizer: global-norm clipping, then AdamW on a linear-warmup + cosine-decay schedule.

lr(t) = lr * t / warmup for t < warmup, then cosine from lr down to lr * min_lr_ratio at `steps`
(a run shorter than the warmup stays in the warmup).
Weight decay applies to weight matrices only (`decay_mask`): never to norm gains, biases or
other scale vectors, whatever their rank.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from flax.core import meta

from neurips26_jax.train.errors import UsageError


def schedule(optim_config, steps: int) -> optax.Schedule:
  c = optim_config
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=c.lr, warmup_steps=c.warmup_steps,
      decay_steps=max(steps, c.warmup_steps + 1), end_value=c.lr * c.min_lr_ratio)


def decay_mask(params):
  """True for the parameters AdamW decays: ndim >= 2 and not a scale (`models.partitioning.scale`
  marks norm gains such as FlashFFN's [H, d_h] one with weight_decay=False).

  `params`: an nnx.State of Variables; or a Linen params tree, as `flax.nnx.bridge.to_linen`
  layers make it (their leaves are boxed metadata carrying the same mark), for
  `optax.adamw(..., mask=decay_mask(variables["params"]))` on the unboxed params; or plain
  arrays, judged by rank alone. Returns a tree of bools that is a prefix of it (of the
  unboxed tree, for boxed leaves)."""
  boxed = lambda x: isinstance(x, (nnx.Variable, meta.AxisMetadata))

  def decays(x):
    if isinstance(x, nnx.Variable):
      return x.ndim >= 2 and x.get_metadata("weight_decay", True)
    if isinstance(x, meta.AxisMetadata):
      return x.unbox().ndim >= 2 and getattr(x, "metadata", {}).get("weight_decay", True)
    return x.ndim >= 2
  return jax.tree.map(decays, params, is_leaf=boxed)


def make_optimizer(optim_config, steps: int) -> optax.GradientTransformation:
  c = optim_config
  return optax.chain(
      optax.clip_by_global_norm(c.clip_norm),
      optax.adamw(schedule(c, steps), b1=c.b1, b2=c.b2, weight_decay=c.weight_decay,
                  mask=decay_mask))


def check_optim_config(c) -> None:
  """UsageError naming the first bad field of config.optim."""
  for name in ("lr", "clip_norm"):
    if not c[name] > 0:
      raise UsageError(f"config.optim.{name} must be > 0, got {c[name]!r}")
  for name in ("weight_decay", "min_lr_ratio"):
    if not c[name] >= 0:
      raise UsageError(f"config.optim.{name} must be >= 0, got {c[name]!r}")
  for name in ("b1", "b2"):
    if not 0 <= c[name] < 1:
      raise UsageError(f"config.optim.{name} must be in [0, 1), got {c[name]!r}")
  if not isinstance(c.warmup_steps, int) or c.warmup_steps < 0:
    raise UsageError(f"config.optim.warmup_steps must be an int >= 0, got {c.warmup_steps!r}")
