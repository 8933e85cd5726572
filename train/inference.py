"""From a workdir back to its model: the run's saved config and a checkpoint's parameters.

  model, config = train.load_model("runs/lm")            # the newest checkpoint that restores
  model, config = train.load_model("runs/lm", step=500)  # a chosen one
  logits = model(tokens); model.generate(prompt, 100)    # a LanguageModel, ready to use

The model is built from `<workdir>/config.json` (what the run was started with) by the task's
own constructor (train.lm_task.make_model for language models, train.seg3d_task.make_model for
the segmenters: the config's fields say which) and its parameters are read from
`<workdir>/checkpoints/<step>`; the optimizer state beside them is not read. The mesh is the
run's own `config.mesh` when it fits this machine's devices, otherwise one device.

`evaluate` is the trainer's evaluation (config.eval_batches batches of the evaluation split) on
such a model; `train_lm --mode=eval|sample` and `train_seg3d --mode=eval` call these.
"""

from __future__ import annotations

import json
import pathlib
import types

import jax
from flax import nnx
from ml_collections import ConfigDict

from neurips26_jax.train import checkpoints as checkpoints_lib
from neurips26_jax.train import sharding, trainer
from neurips26_jax.train.errors import UsageError

SINGLE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}


def _tuples(value):
  """JSON has no tuples: lists of numbers (shapes, patch and block sizes) become tuples again,
  as the config files write them."""
  if isinstance(value, dict):
    return {k: _tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    items = [_tuples(v) for v in value]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in items)
    return tuple(items) if numeric and items else items
  return value


def load_config(workdir: str | pathlib.Path) -> ConfigDict:
  """The config a run was started with (`<workdir>/config.json`); UsageError if there is none."""
  path = pathlib.Path(workdir) / "config.json"
  try:
    return ConfigDict(_tuples(json.loads(path.read_text())))
  except OSError as e:
    raise UsageError(f"--workdir={workdir}: cannot read {path} ({e.strerror or e}); expected "
                     "the workdir of a training run") from None
  except ValueError as e:
    raise UsageError(f"--workdir={workdir}: {path} is not a JSON config ({e})") from None


def task_module(config: ConfigDict) -> types.ModuleType:
  """train.lm_task or train.seg3d_task, whichever trains the model config.model describes."""
  # they import this module's callers
  from neurips26_jax.train import lm_task, seg3d_task  # noqa: PLC0415
  if "vocab_size" in config.model:
    return lm_task
  if "kind" in config.model:
    return seg3d_task
  raise UsageError(f"config.model has neither vocab_size (a language model) nor kind (a 3D "
                   f"segmenter): fields {sorted(config.model.keys())}")


def inference_config(config: ConfigDict) -> ConfigDict:
  """config with its mesh kept if it fits this machine's devices, else one device."""
  config = ConfigDict(config.to_dict())
  try:
    sharding.mesh_shape(config.mesh, jax.device_count())
  except UsageError:
    config.mesh = SINGLE_DEVICE
  return config


def load_model(workdir: str | pathlib.Path, step: int | None = None, *,
               config: ConfigDict | None = None) -> tuple[nnx.Module, ConfigDict]:
  """-> (model, config): the model of the run in `workdir` with the parameters of checkpoint
  `step` (None: the newest that restores; unreadable ones are skipped with a warning, and left
  in place), and the run's config (`config` instead of `<workdir>/config.json` if given: it must
  describe the same model). UsageError, naming what is wrong, for a workdir without a config or
  checkpoints, a missing step, or checkpoints of another model.
  """
  model, config, _ = load(workdir, step, config=config)
  return model, config


def load(workdir: str | pathlib.Path, step: int | None = None, *,
         config: ConfigDict | None = None) -> tuple[nnx.Module, ConfigDict, int]:
  """load_model, plus the step of the checkpoint it read."""
  workdir = pathlib.Path(workdir)
  config = inference_config(load_config(workdir) if config is None else config)
  model, step = restore_params(task_module(config).make_model(config), workdir, step)
  return model, config, step


def restore_params(model: nnx.Module, workdir: str | pathlib.Path,
                   step: int | None = None) -> tuple[nnx.Module, int]:
  """-> (model, step): `model` (built like the run's: a model the trainer's tasks do not
  build, e.g. an experiment's) with the parameters of checkpoint `step` of the run in
  `workdir` (None: the newest that restores), and the step read."""
  directory = pathlib.Path(workdir) / "checkpoints"
  if not directory.is_dir():
    raise UsageError(f"--workdir={workdir}: no checkpoints/ in it; expected the workdir of a "
                     "training run that saved at least one checkpoint")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  reader = checkpoints_lib.Checkpoints(directory, read_only=True)
  try:
    step, params = reader.restore_params(params, step=step)
  finally:
    reader.close()
  return nnx.merge(graphdef, params, rest), step


def evaluate(model: nnx.Module, config: ConfigDict) -> dict[str, float]:
  """{"eval_loss", ...} of `model` as the trainer computes them: the mean over
  config.eval_batches batches of the evaluation split (eval_accuracy, eval_dice where the task
  has them)."""
  config = inference_config(config)
  task = task_module(config).build_task(config, model=model)
  mesh = sharding.make_mesh(config.mesh)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  with jax.set_mesh(mesh):
    return trainer.evaluator(task, lambda p: nnx.merge(graphdef, p, rest), mesh, config)(params)
