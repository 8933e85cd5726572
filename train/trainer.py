"""One trainer for every task: sharded jitted steps, evaluation, checkpoints, metrics.

A `Task` says what to train: a freshly initialised model, a loss, and batches as pure functions of the step
(training) or of an index (evaluation). `fit` does the rest:

  state = {"step", "params", "opt_state"}     params float32, sharded by logical axes
  state', metrics = train_step(state, batch)  jitted, state donated; AdamW + clipping (train/optim)
  every config.eval_every steps: mean loss over config.eval_batches evaluation batches
  every config.checkpoint_every steps (and at the end): orbax checkpoint, newest few kept
  start: resume from the newest checkpoint in workdir/checkpoints, if any

`step` is also the data position (batch = task.train_batch(step)), so a stopped and resumed run
reproduces the uninterrupted run's losses exactly. A non-finite loss raises NonFiniteLossError
naming the step; nothing after the last good checkpoint is saved.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import metrics as metrics_lib
from train import optim, sharding
from train.checkpoints import Checkpoints

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class NonFiniteLossError(RuntimeError):
  """The training loss became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class Task:
  """What to train.

  model: the nnx.Module with its initial (float32) parameters, seeded from the config; it is
    built eagerly on one device and then sharded, so its constructor need not be traceable.
  loss_fn: (model, batch) -> (scalar loss, {name: scalar}) on device arrays.
  train_batch: step -> {name: np.ndarray [global_batch, ...]}, a pure function of the step.
  eval_batch: index -> the same, for evaluation.
  tokens_per_batch: for the tokens/s figure.
  """
  model: nnx.Module
  loss_fn: Callable[[nnx.Module, dict], tuple[jax.Array, dict]]
  train_batch: Callable[[int], dict]
  eval_batch: Callable[[int], dict]
  tokens_per_batch: int


@dataclasses.dataclass
class FitResult:
  model: nnx.Module          # with the final parameters
  final_loss: float | None  # None when no step ran (the run was already complete)
  eval_loss: float | None
  steps_per_s: float
  workdir: pathlib.Path


def resolve_impl(impl: str) -> str:
  """Kernel choice: "auto" is "pallas" on TPU/GPU and "xla" on CPU; other values pass through."""
  if impl != "auto":
    return impl
  return "pallas" if jax.default_backend() in ("tpu", "gpu", "cuda", "rocm") else "xla"


def compute_dtype(config):
  return COMPUTE_DTYPES[config.compute_dtype]


def check_config(config) -> None:
  """ValueError naming the first bad generic field (mesh, batch, intervals, optimizer, dtype)."""
  for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches",
               "checkpoint_every", "keep_checkpoints"):
    value = config[name]
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"config.{name} must be a positive int, got {value!r}")
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise ValueError(f"config.compute_dtype must be one of {tuple(COMPUTE_DTYPES)}, "
                     f"got {config.compute_dtype!r}")
  shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, jax.device_count())))
  divisor = math.prod(shape[a] for a in sharding.BATCH_AXES)
  if config.batch_size % divisor:
    raise ValueError(f"config.batch_size ({config.batch_size}) must be divisible by "
                     f"config.mesh.data * config.mesh.fsdp = {divisor}")
  optim.check_optim_config(config.optim)


def _init_state(task: Task, tx, mesh):
  """Fresh sharded state and the graph pieces to rebuild the model from params."""
  graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)
  # copies (may_alias=False): the donated train state must not own task.model's arrays
  params = jax.device_put(params, sharding.param_shardings(task.model, params, mesh),
                          may_alias=False)
  rest = jax.device_put(rest, NamedSharding(mesh, P()), may_alias=False)
  state = {"step": jnp.zeros((), jnp.int32), "params": params,
           "opt_state": jax.jit(tx.init)(params)}
  return graphdef, rest, state


def _with_loss(loss_and_aux):
  loss, aux = loss_and_aux
  return {"loss": loss, **aux}


def fit(config, workdir: str | pathlib.Path, task: Task) -> FitResult:
  """Train `task` for config.steps steps (resuming from workdir's newest checkpoint)."""
  check_config(config)
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh)
  tx = optim.make_optimizer(config.optim, config.steps)
  lr = optim.schedule(config.optim, config.steps)
  with jax.set_mesh(mesh):
    graphdef, rest, state = _init_state(task, tx, mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    model_of = lambda params: nnx.merge(graphdef, params, rest)

    def train_step(state, batch):
      grad_fn = jax.value_and_grad(lambda p: task.loss_fn(model_of(p), batch), has_aux=True)
      (loss, aux), grads = grad_fn(state["params"])
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
             "opt_state": opt_state}
      return new, {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr(state["step"]),
                   **aux}

    train_step = jax.jit(train_step, in_shardings=(state_sh, None), out_shardings=(state_sh, None),
                         donate_argnums=0)
    eval_fn = jax.jit(lambda params, batch: _with_loss(task.loss_fn(model_of(params), batch)))

    checkpoints = Checkpoints(workdir / "checkpoints", every=config.checkpoint_every,
                              keep=config.keep_checkpoints)
    restored = checkpoints.restore_latest(state)
    if restored is not None:
      state = restored
    start = int(state["step"])
    if jax.process_index() == 0:
      (workdir / "config.json").write_text(config.to_json(indent=2))
    writer = metrics_lib.MetricWriter(workdir, resume_step=start)
    bar = metrics_lib.ProgressBar(config.steps, task.tokens_per_batch)
    if start:
      print(f"Resuming from the checkpoint at step {start} in {checkpoints.manager.directory}")

    def record(step, step_metrics):
      values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
      if not math.isfinite(values["loss"]):
        raise NonFiniteLossError(
            f"loss is {values['loss']} at step {step}: stopping. The newest good checkpoint is "
            f"step {checkpoints.latest_step()} in {checkpoints.manager.directory}")
      bar.update(step, values["loss"])
      if step % config.log_every == 0 or step + 1 == config.steps:
        writer.write(step, {**values, "steps_per_s": bar.rate,
                            "tokens_per_s": bar.rate * task.tokens_per_batch})
      return values["loss"]

    def evaluate(params):
      """{"eval_" + name: mean over the evaluation batches} for the loss and the aux metrics."""
      rows = jax.device_get([eval_fn(params, sharding.put_batch(task.eval_batch(i), mesh))
                             for i in range(config.eval_batches)])
      return {f"eval_{k}": float(np.mean([r[k] for r in rows])) for k in rows[0]}

    pending, loss, eval_loss = None, None, None
    try:
      for step in range(start, config.steps):
        state, step_metrics = train_step(state, sharding.put_batch(task.train_batch(step), mesh))
        if pending is not None:
          loss = record(*pending)        # one step behind: the host check overlaps the next step
        pending = (step, step_metrics)
        done = step + 1
        if done % config.eval_every == 0 or checkpoints.due(done, config.steps):
          loss, pending = record(*pending), None
          if done % config.eval_every == 0 or done == config.steps:
            eval_metrics = evaluate(state["params"])
            eval_loss = eval_metrics["eval_loss"]
            writer.write(step, eval_metrics)
          if checkpoints.due(done, config.steps):
            checkpoints.save(done, state)
    finally:
      bar.close()
      checkpoints.close()
      writer.close()
    summary = {"final_loss": loss, "eval_loss": eval_loss, "steps_per_s": bar.rate}
    if jax.process_index() == 0:
      if writer.path.exists():
        metrics_lib.plot_losses(writer.path, workdir / "loss.png")
      (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return FitResult(model=model_of(state["params"]), workdir=workdir, **summary)
