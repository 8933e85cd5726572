"""3D segmentation of procedural cell volumes: config -> Task for the trainer.

config.model.kind:
  "pack3d"  Pack3DSegmenter on packed fields (config.data.fields_per_item volumes of different
            shapes per sequence of config.data.num_tokens patch tokens)
  "unet3d"  UNet3D on the same volumes, each zero-padded to the largest shape; its
            base_channels = 0 means "match the Pack3DSegmenter's parameter count"
Loss: voxel cross entropy over real voxels (padding masked); metric: macro Dice over the
foreground classes (cytoplasm, nucleus, structure) of the argmax prediction.
Every batch is checked on the host first (`check_batch`: finite voxels, labels in
[0, NUM_CLASSES), mask in [0, 1], coords >= 0 and field ids in [0, MAX_FIELDS)).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops.pack3d_layout import MAX_FIELDS
from neurips26_jax.models.seg3d import Pack3DSegmenter
from neurips26_jax.models.unet3d import UNet3D, param_count, unet3d_matching
from neurips26_jax.train import sharding, trainer
from neurips26_jax.train.data import volumes
from neurips26_jax.train.errors import UsageError
from neurips26_jax.train.losses import masked_cross_entropy

KINDS = ("pack3d", "unet3d")


def segmentation_loss(logits, labels, mask):
  """logits [..., K], labels int [...], mask [...] -> (masked mean CE, {"dice": macro Dice})."""
  loss, _ = masked_cross_entropy(logits, labels, mask)
  pred = jnp.argmax(logits, -1)
  dice = []
  for c in range(1, logits.shape[-1]):
    p, g = (pred == c) * mask, (labels == c) * mask
    dice.append((2 * (p * g).sum() + 1.0) / (p.sum() + g.sum() + 1.0))
  return loss, {"dice": jnp.mean(jnp.stack(dice))}


def pack3d_loss(model, batch):
  logits = model(batch["tokens"], batch["coords"], batch["field_ids"])
  mask = jnp.broadcast_to(batch["mask"][..., None], batch["labels"].shape)
  return segmentation_loss(logits, batch["labels"], mask)


def unet_loss(model, batch):
  return segmentation_loss(model(batch["image"]), batch["labels"], batch["mask"])


def _pack3d(config, dtype):
  c = config.model
  return Pack3DSegmenter(
      patch=tuple(config.data.patch), in_channels=1, num_classes=volumes.NUM_CLASSES,
      d_model=c.d_model, depth=c.depth, num_heads=c.num_heads, ffn=c.ffn,
      ffn_options=c.ffn_options.to_dict(), attention_options=c.attention_options.to_dict(),
      impl=c.impl, dtype=dtype,
      rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")))


def make_model(config) -> nnx.Module:
  """The model config.model.kind, its parameters created already sharded over the config's mesh
  (train.sharding.init_sharded); UsageError naming config.model if it cannot be built."""
  kind = config.model.kind
  if kind not in KINDS:
    raise UsageError(f"config.model.kind must be one of {KINDS}, got {kind!r}")
  dtype = trainer.compute_dtype(config)
  mesh = sharding.make_mesh(config.mesh)
  try:
    if kind == "pack3d":
      return sharding.init_sharded(lambda: _pack3d(config, dtype), mesh)
    base = config.model.unet.base_channels or unet3d_matching(
        param_count(nnx.eval_shape(lambda: _pack3d(config, dtype))),
        levels=config.model.unet.levels, num_classes=volumes.NUM_CLASSES)
    return sharding.init_sharded(
        lambda: UNet3D(in_channels=1, num_classes=volumes.NUM_CLASSES, base_channels=base,
                       levels=config.model.unet.levels, dtype=dtype,
                       rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg"))), mesh)
  except (ValueError, TypeError, ImportError) as e:
    raise UsageError(f"config.model is invalid: {e}") from e


def check_batch(owner: str, batch: dict) -> None:
  """Task.check_batch for both views (packed: tokens, coords, field_ids; dense: image)."""
  k = volumes.NUM_CLASSES
  for name in ("tokens", "image"):
    if name in batch:
      checks.values(owner, name, batch[name], checks.finite, "be finite")
  checks.integer(owner, "labels", batch["labels"])
  checks.values(owner, "labels", batch["labels"], lambda v: (v >= 0) & (v < k),
                f"hold classes in [0, {k})")
  checks.values(owner, "mask", batch["mask"], lambda m: (m >= 0) & (m <= 1), "lie in [0, 1]")
  if "coords" in batch:
    checks.values(owner, "coords", batch["coords"], lambda c: c >= 0, "be >= 0")
    checks.values(owner, "field_ids", batch["field_ids"],
                  lambda f: (f >= 0) & (f < MAX_FIELDS), f"lie in [0, {MAX_FIELDS})")


def dense_shape(shapes, levels: int) -> tuple[int, ...]:
  """The per-axis maximum of `shapes`, rounded up to a multiple of 2^(levels - 1)."""
  f = 2 ** (levels - 1)
  return tuple(f * math.ceil(max(s[a] for s in shapes) / f) for a in range(3))


def build_task(config, model: nnx.Module | None = None) -> trainer.Task:
  """The Task of config; `model` (e.g. train.load_model's) instead of a fresh make_model(config).
  Prints the model's parameter count (process 0)."""
  d = config.data
  shapes = [tuple(s) for s in d.shapes]
  try:
    volumes.check_shapes(shapes, d.patch, d.num_tokens, d.fields_per_item)
  except ValueError as e:
    raise UsageError(f"config.data is invalid: {e}") from e
  if model is None:
    model = make_model(config)
    if jax.process_index() == 0:
      print(f"{type(model).__name__}: {param_count(model):,} parameters")
  fields = functools.partial(volumes.sample_fields, seed=config.seed,
                             count=config.batch_size * d.fields_per_item, shapes=shapes)
  if config.model.kind == "pack3d":
    view = functools.partial(volumes.pack, items=config.batch_size, patch=tuple(d.patch),
                             num_tokens=d.num_tokens)
    loss_fn, tokens = pack3d_loss, config.batch_size * d.num_tokens
  else:
    shape = dense_shape(shapes, config.model.unet.levels)
    view = functools.partial(volumes.pad, max_shape=shape)
    loss_fn = unet_loss
    tokens = config.batch_size * d.fields_per_item * math.prod(shape) // math.prod(d.patch)
  return trainer.Task(
      model=model, loss_fn=loss_fn,
      train_batch=lambda step: view(fields(stream=0, index=step)),
      eval_batch=lambda i: view(fields(stream=1, index=i)),
      tokens_per_batch=tokens, check_batch=check_batch)


def train_and_evaluate(config, workdir: str) -> trainer.FitResult:
  trainer.check_config(config)
  result = trainer.fit(config, workdir, build_task(config))
  if result.stopped or result.already_complete:   # fit said which step is saved and what to do
    return result
  if jax.process_index() == 0:
    print(f"final train loss {result.final_loss}, eval loss {result.eval_loss}; "
          f"outputs in {result.workdir.absolute()}: checkpoints/, metrics.jsonl (eval_dice), "
          "tb/, loss.png")
  return result
