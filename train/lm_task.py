"""Language modelling: config -> Task for the trainer, then a sample at the end.

config.data.kind picks the data:
  "text"                                 next-byte prediction on windows of a corpus
                                         (train.data.text; config.data.path, default stdlib)
  "mqar", "lag_recall", "selective_copy" synthetic recall tasks (train.data.synthetic) with
                                         config.data.vocab and config.data.options
Batches are {"inputs", "targets": int [B, L]} (+ "mask" [B, L] for the synthetic tasks), each
checked on the host (`check_batch`: ids in [0, vocab_size), mask in [0, 1]);
loss = mean cross entropy (nats/token) over the (masked) positions, plus accuracy when masked.
config.model.impl "auto" picks "pallas" where the backend compiles the kernels, else "xla"
(models.impl: the layers resolve it).
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from neurips26_jax.jaxops import checks
from neurips26_jax.models.lm import LanguageModel
from neurips26_jax.models.unet3d import param_count
from neurips26_jax.train import sharding, trainer
from neurips26_jax.train.data import synthetic, text
from neurips26_jax.train.errors import UsageError
from neurips26_jax.train.losses import chunked_cross_entropy


def make_model(config) -> LanguageModel:
  """LanguageModel from config.model, its parameters created already sharded over the config's
  mesh (train.sharding.init_sharded: under jax.jit, each device computes only its shards);
  UsageError naming config.model if it cannot be built.

  Initialisation draws from the "rbg" PRNG: it compiles ~4x faster than threefry on CPU.
  """
  kwargs = config.model.to_dict()
  mesh = sharding.make_mesh(config.mesh)
  try:
    return sharding.init_sharded(
        lambda: LanguageModel(**kwargs, dtype=trainer.compute_dtype(config),
                              rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg"))), mesh)
  except (ValueError, TypeError, ImportError) as e:
    raise UsageError(f"config.model is invalid: {e}") from e


def lm_loss(model, batch):
  """-> (mean cross entropy of targets over the masked positions, {"accuracy"} if masked).

  The logits are computed a chunk of positions at a time from the model's final features
  (`train.losses.chunked_cross_entropy`): a large vocabulary's [B, L, V] float32 logits and
  their gradient are never held whole."""
  mask = batch.get("mask")
  loss, accuracy = chunked_cross_entropy(model.features(batch["inputs"]), model.logits,
                                         batch["targets"], mask)
  return loss, ({} if mask is None else {"accuracy": accuracy})


def batch_checker(vocab_size: int):
  """Task.check_batch for LM batches: inputs and targets integer ids in [0, vocab_size) (an id
  past the vocabulary would silently read the last embedding row under jit), mask in [0, 1]."""
  def check(owner: str, batch: dict) -> None:
    for name in ("inputs", "targets"):
      checks.integer(owner, name, batch[name])
      checks.values(owner, name, batch[name], lambda t: (t >= 0) & (t < vocab_size),
                    f"hold token ids in [0, vocab_size={vocab_size})")
    if "mask" in batch:
      checks.values(owner, "mask", batch["mask"], lambda m: (m >= 0) & (m <= 1), "lie in [0, 1]")
  return check


def text_batches(config):
  """(train_batch(step), eval_batch(i)) of next-byte windows; UsageError naming config.data.path
  if the corpus cannot be read or is too short for the windows."""
  expected = "expected a readable text file, or '' for the Python stdlib source"
  if config.data.path and not pathlib.Path(config.data.path).is_file():
    raise UsageError(f"config.data.path={config.data.path!r} is not a file; {expected}")
  try:
    train_bytes, val_bytes = text.split(
        text.load_corpus(config.data.path, max_bytes=config.data.max_bytes),
        config.data.val_fraction)
  except (OSError, ValueError) as e:
    raise UsageError(f"config.data.path={config.data.path!r}: {e}; {expected}") from e

  def batch(data, stream, index):
    w = text.windows(data, seed=config.seed, stream=stream, index=index,
                     batch=config.batch_size, length=config.model.context)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}

  train_batch = functools.partial(batch, train_bytes, text.TRAIN)
  eval_batch = functools.partial(batch, val_bytes, text.VAL)
  try:                                           # fail now, not at the first step
    train_batch(index=0), eval_batch(index=0)
  except ValueError as e:
    raise UsageError(f"config.data.path={config.data.path!r} with config.data.max_bytes="
                     f"{config.data.max_bytes}: {e}") from e
  return train_batch, eval_batch


def synthetic_batches(config):
  """(train_batch(step), eval_batch(i)) of the synthetic task config.data.kind."""
  c = config.data
  if not 0 < c.vocab <= config.model.vocab_size:
    raise UsageError(f"config.data.vocab ({c.vocab}) must be in [1, config.model.vocab_size]")
  make = functools.partial(synthetic.TASKS[c.kind], seed=config.seed, batch=config.batch_size,
                           length=config.model.context, vocab=c.vocab, **c.options)
  try:
    make(stream=text.VAL, index=0)
  except (ValueError, TypeError) as e:
    raise UsageError(f"config.data.options do not fit config.data.kind={c.kind!r}: {e}") from e
  return (functools.partial(make, stream=text.TRAIN), functools.partial(make, stream=text.VAL))


def build_task(config, model: LanguageModel | None = None) -> trainer.Task:
  """The Task of config; `model` (e.g. train.load_model's) instead of a fresh make_model(config).
  Prints the model's parameter count (process 0)."""
  kinds = ("text",) + tuple(synthetic.TASKS)
  if config.data.kind not in kinds:
    raise UsageError(f"config.data.kind must be one of {kinds}, got {config.data.kind!r}")
  batches = text_batches if config.data.kind == "text" else synthetic_batches
  train_batch, eval_batch = batches(config)        # data errors first: the model is slower
  if model is None:
    model = make_model(config)
    if jax.process_index() == 0:
      print(f"{type(model).__name__}: {param_count(model):,} parameters")
  return trainer.Task(model=model, loss_fn=lm_loss,
                      train_batch=lambda step: train_batch(index=step),
                      eval_batch=lambda i: eval_batch(index=i),
                      tokens_per_batch=config.batch_size * config.model.context,
                      check_batch=batch_checker(config.model.vocab_size))


def sample(model: LanguageModel, config) -> str:
  """Decode config.sample.num_tokens bytes after config.sample.prompt, token by token."""
  check_sample_config(config)
  prompt = jnp.asarray([list(config.sample.prompt.encode())], jnp.int32)
  out = model.generate(prompt, config.sample.num_tokens,
                       temperature=config.sample.temperature, seed=config.seed)
  return bytes(int(t) for t in jax.device_get(out[0])).decode("utf-8", errors="replace")


def check_sample_config(config) -> None:
  """The attention KV cache holds config.model.context tokens: the sample must fit in it."""
  length = len(config.sample.prompt.encode()) + config.sample.num_tokens
  if config.model.mixer == "attention" and length > config.model.context:
    raise UsageError(f"config.sample.num_tokens: prompt + {config.sample.num_tokens} tokens = "
                     f"{length} exceed the attention context config.model.context = "
                     f"{config.model.context}")


def train_and_evaluate(config, workdir: str) -> trainer.FitResult:
  """Train the LM, print a generated sample, say where the outputs are (after a signal: only
  what fit printed, the saved step and how to resume; for a run already complete, only that)."""
  trainer.check_config(config)
  check_sample_config(config)
  if config.data.get("path"):     # config.json then names the corpus from any directory
    config.data.path = os.path.abspath(config.data.path)
  result = trainer.fit(config, workdir, build_task(config))
  if result.stopped or result.already_complete:
    return result
  if config.sample.num_tokens > 0:
    text_out = sample(result.model, config)       # every process decodes (same result)
    if jax.process_index() == 0:
      (result.workdir / "sample.txt").write_text(text_out)
      print_sample(text_out, config)
  if jax.process_index() == 0:
    fmt = lambda x, spec=".4f": "n/a" if x is None else format(x, spec)
    print(f"final train loss {fmt(result.final_loss)}, eval loss {fmt(result.eval_loss)}, "
          f"{fmt(result.steps_per_s, '.2f')} steps/s\n"
          f"outputs in {result.workdir.absolute()}: checkpoints/, metrics.jsonl, tb/, loss.png, "
          "sample.txt, config.json")
  return result


def print_sample(text_out: str, config) -> None:
  print(f"--- sample (recurrent decoding, temperature {config.sample.temperature}) ---\n"
        f"{text_out}\n---")
