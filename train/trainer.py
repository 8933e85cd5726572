"""One trainer for every task: sharded jitted steps, evaluation, checkpoints, metrics.

A `Task` says what to train: a freshly initialised model, a loss, and batches as pure functions of the step
(training) or of an index (evaluation). `fit` does the rest:

  state = {"step", "params", "opt_state"}     params float32, sharded by logical axes
  state', metrics = train_step(state, batch)  jitted, state donated; AdamW + clipping (train/optim)
  every config.eval_every steps: mean loss over config.eval_batches evaluation batches
  every config.checkpoint_every steps (and at the end): orbax checkpoint, newest few kept
  start: resume from the newest checkpoint in workdir/checkpoints that restores, if any; one at
         or past config.steps means the run is already complete: fit says so, trains nothing
         and writes nothing (config.json and summary.json stay those of the finished run)
  progress: a bar on stderr (process 0 only) with steps/s and tokens/s of the training steps
         alone (evaluation and checkpoint time excluded), also logged and in summary.json

`step` is also the data position (batch = task.train_batch(step)), so a stopped and resumed run
reproduces the uninterrupted run's losses exactly.

Crash safety (every checkpoint on disk is complete and finite):
- a non-finite loss or gradient norm raises NonFiniteLossError naming the step, before anything
  from that step is saved; a non-finite state at a save raises NonFiniteStateError instead;
- a batch that fails the task's host-side check (token ids outside the vocabulary, labels
  outside the classes, non-finite inputs) raises BadBatchError naming the step and the field
  before it reaches the devices;
- SIGTERM or SIGINT saves the current step once and returns normally (FitResult.stopped names
  the signal); a save in flight is finished first, so the rerun resumes from the newest step;
  with several processes (multi-host) a signal to any of them stops all after the same step;
- a damaged newest checkpoint is set aside and the next older one restored (train.checkpoints);
  checkpoints of another model raise a UsageError saying what differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import signal
import sys
import tempfile
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from neurips26_jax.train import metrics as metrics_lib
from neurips26_jax.train import optim, sharding
from neurips26_jax.train.checkpoints import Checkpoints, DifferentModelError
from neurips26_jax.train.errors import TrainingError, UsageError

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class NonFiniteLossError(TrainingError):
  """The training loss or gradient norm became NaN or infinite."""


class BadBatchError(TrainingError):
  """A batch from the task failed its host-side value check (Task.check_batch)."""


@dataclasses.dataclass(frozen=True)
class Task:
  """What to train.

  model: the nnx.Module with its initial (float32) parameters, seeded from the config; the
    tasks create it already sharded over the mesh (`train.sharding.init_sharded`: the
    constructor runs under jax.jit with out_shardings from the parameters' logical axes).
  loss_fn: (model, batch) -> (scalar loss, {name: scalar}) on device arrays.
  train_batch: step -> {name: np.ndarray [global_batch, ...]}, a pure function of the step.
  eval_batch: index -> the same, for evaluation.
  tokens_per_batch: for the tokens/s figure.
  check_batch: optional (owner, batch) -> None, raising ValueError (naming `owner` and the
    field) for values the model cannot take: token ids outside the vocabulary, labels outside
    the classes, non-finite inputs. It runs on the host, on every batch before it reaches the
    devices (inside a jitted step such a value would silently read the wrong row or poison
    the run); a few numpy reductions per batch.
  """
  model: nnx.Module
  loss_fn: Callable[[nnx.Module, dict], tuple[jax.Array, dict]]
  train_batch: Callable[[int], dict]
  eval_batch: Callable[[int], dict]
  tokens_per_batch: int
  check_batch: Callable[[str, dict], None] | None = None


@dataclasses.dataclass
class FitResult:
  model: nnx.Module          # with the final parameters
  final_loss: float | None  # when the run was already complete: from its summary.json, if any
  eval_loss: float | None
  steps_per_s: float | None  # training steps only (evaluation and checkpoint time excluded)
  workdir: pathlib.Path
  stopped: str | None = None  # the signal (SIGTERM, SIGINT) that stopped the run early, if any
  already_complete: bool = False  # the newest checkpoint was at or past config.steps: nothing ran


def compute_dtype(config):
  return COMPUTE_DTYPES[config.compute_dtype]


# The fields fit reads (configs/lm_smoke.py shows them with the tasks' own).
REQUIRED_FIELDS = ("steps", "batch_size", "compute_dtype", "log_every", "eval_every",
                   "eval_batches", "checkpoint_every", "keep_checkpoints",
                   *(f"mesh.{a}" for a in sharding.MESH_AXES),
                   *(f"optim.{k}" for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay",
                                            "b1", "b2", "clip_norm")))


def check_config(config) -> None:
  """UsageError naming the first missing or bad generic field (mesh, batch, intervals,
  optimizer, dtype)."""
  for field in REQUIRED_FIELDS:
    parent, _, leaf = field.rpartition(".")
    if leaf not in (config[parent] if parent else config):
      raise UsageError(f"config.{field} is missing: a config file must set every field that "
                       "configs/lm_smoke.py sets")
  for name in ("steps", "batch_size", "log_every", "eval_every", "eval_batches",
               "checkpoint_every", "keep_checkpoints"):
    value = config[name]
    if not isinstance(value, int) or value < 1:
      raise UsageError(f"config.{name} must be a positive int, got {value!r}")
  if config.compute_dtype not in COMPUTE_DTYPES:
    raise UsageError(f"config.compute_dtype must be one of {tuple(COMPUTE_DTYPES)}, "
                     f"got {config.compute_dtype!r}")
  shape = dict(zip(sharding.MESH_AXES, sharding.mesh_shape(config.mesh, jax.device_count())))
  divisor = math.prod(shape[a] for a in sharding.BATCH_AXES)
  if config.batch_size % divisor:
    raise UsageError(f"config.batch_size ({config.batch_size}) must be divisible by "
                     f"config.mesh.data * config.mesh.fsdp = {divisor}")
  optim.check_optim_config(config.optim)


def prepare_workdir(workdir: str | pathlib.Path) -> pathlib.Path:
  """Creates `workdir` if needed and proves it writable; UsageError at once otherwise."""
  path = pathlib.Path(workdir)
  try:
    path.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=path).close()
  except OSError as e:
    raise UsageError(f"--workdir={workdir}: cannot create or write to it ({e.strerror or e}); "
                     "expected a writable directory") from None
  return path


def _model_change(workdir: pathlib.Path, config) -> str:
  """The config.model fields that differ from workdir/config.json, in words ("" if unknown)."""
  try:
    saved = json.loads((workdir / "config.json").read_text())["model"]
  except (OSError, ValueError, KeyError):
    return ""
  now = json.loads(config.to_json())["model"]

  def flat(d, prefix="config.model"):
    out = {}
    for k, v in d.items():
      out.update(flat(v, f"{prefix}.{k}") if isinstance(v, dict) else {f"{prefix}.{k}": v})
    return out

  saved, now = flat(saved), flat(now)
  return ", ".join(f"{k} was {saved.get(k)!r}, now {now.get(k)!r}"
                   for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k))


class _StopSignals:
  """While active, SIGTERM and SIGINT set `name` (the loop then saves and stops) instead of
  ending the process. A second signal restores the previous handlers and is raised again, to stop
  at once without saving (KeyboardInterrupt for SIGINT; for SIGTERM Python's default ends the
  process). Inactive off the main thread (Python installs handlers only there).
  """

  def __init__(self):
    self.name, self.agreed, self._previous = None, None, {}

  def agree(self) -> str | None:
    """-> `agreed`: the signal to stop for after this step, the same on every process. `name`
    is read once (a signal later in the step waits a step); with several processes, any
    process's signal counts (a scalar all-gather per step: saving is collective, so all must
    stop at the same step)."""
    name = self.name
    if jax.process_count() > 1:
      codes = multihost_utils.process_allgather(np.int32(signal.Signals[name] if name else 0))
      name = signal.Signals(int(codes.max())).name if codes.max() else None
    self.agreed = name
    return name

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
    return self

  def __exit__(self, *exc_info):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum, frame):
    del frame
    if self.name is not None:
      self.__exit__()
      signal.raise_signal(signum)
      return
    self.name = signal.Signals(signum).name
    sys.stderr.write(f"\n{self.name}: saving the current step, then stopping "
                     "(send it again to stop at once, without saving)\n")


def _init_state(task: Task, tx, mesh):
  """Fresh sharded state and the graph pieces to rebuild the model from params."""
  graphdef, params, rest = nnx.split(task.model, nnx.Param, ...)
  # copies (may_alias=False): the donated train state must not own task.model's arrays
  params = jax.device_put(params, sharding.state_shardings(params, mesh),
                          may_alias=False)
  rest = jax.device_put(rest, NamedSharding(mesh, P()), may_alias=False)
  init = jax.jit(tx.init, out_shardings=sharding.optimizer_shardings(tx, params, mesh))
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": init(params)}
  return graphdef, rest, state


def _batch(task: Task, kind: str, index: int) -> dict:
  """task.train_batch(index) ("train") or task.eval_batch(index) ("eval"), checked."""
  batch = (task.train_batch if kind == "train" else task.eval_batch)(index)
  if task.check_batch is not None:
    where = f"training batch at step {index}" if kind == "train" else f"evaluation batch {index}"
    try:
      task.check_batch(where, batch)
    except ValueError as e:
      raise BadBatchError(f"{e}: stopping before it reaches the model") from None
  return batch


def _with_loss(loss_and_aux):
  loss, aux = loss_and_aux
  return {"loss": loss, **aux}


def evaluator(task: Task, model_of: Callable, mesh, config) -> Callable[..., dict]:
  """-> evaluate(params): {"eval_" + name: mean over task.eval_batch(i), i < config.eval_batches}
  for the loss and the task's aux metrics, with the model model_of(params); one jitted step per
  batch."""
  eval_fn = jax.jit(lambda params, batch: _with_loss(task.loss_fn(model_of(params), batch)))

  def evaluate(params) -> dict:
    rows = jax.device_get([eval_fn(params, sharding.put_batch(_batch(task, "eval", i), mesh))
                           for i in range(config.eval_batches)])
    return {f"eval_{k}": float(np.mean([r[k] for r in rows])) for k in rows[0]}

  return evaluate


def _already_complete(config, workdir: pathlib.Path, step: int, model) -> FitResult:
  """The FitResult of a run whose newest checkpoint is at or past config.steps: nothing is
  trained or written (config.json and summary.json stay those of the run that finished)."""
  summary_path = workdir / "summary.json"
  try:
    summary = json.loads(summary_path.read_text())
  except (OSError, ValueError):
    summary = {}
  if jax.process_index() == 0:
    print(f"already complete at step {step} (config.steps = {config.steps}): nothing to train; "
          f"its outputs in {workdir.absolute()} are unchanged")
  return FitResult(model=model, workdir=workdir, already_complete=True,
                   final_loss=summary.get("final_loss"), eval_loss=summary.get("eval_loss"),
                   steps_per_s=summary.get("steps_per_s"))


def fit(config, workdir: str | pathlib.Path, task: Task) -> FitResult:
  """Train `task` for config.steps steps, resuming from workdir's newest checkpoint that
  restores; returns early, after saving, on SIGTERM/SIGINT (see the module docstring)."""
  check_config(config)
  workdir = prepare_workdir(workdir)
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
    evaluate = evaluator(task, model_of, mesh, config)

    checkpoints = Checkpoints(workdir / "checkpoints", every=config.checkpoint_every,
                              keep=config.keep_checkpoints, last=config.steps)
    try:
      restored = checkpoints.restore_latest(state)
    except DifferentModelError as e:
      checkpoints.close()
      change = _model_change(workdir, config)
      raise UsageError(
          f"{checkpoints.directory} holds checkpoints of a different model "
          f"({change or e}): use a new --workdir, or the config that wrote them") from None
    if restored is not None:
      state = restored
    start = int(state["step"])
    if start >= config.steps:
      checkpoints.close()
      return _already_complete(config, workdir, start, model_of(state["params"]))
    if jax.process_index() == 0:
      (workdir / "config.json").write_text(config.to_json(indent=2))
    writer = metrics_lib.MetricWriter(workdir, resume_step=start)
    bar = metrics_lib.ProgressBar(config.steps, task.tokens_per_batch,
                                  active=jax.process_index() == 0)
    if start and jax.process_index() == 0:
      print(f"Resuming from the checkpoint at step {start} in {checkpoints.directory}")

    def record(step, step_metrics):
      values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
      # checked here, one step behind, and always before the next save: nothing computed from a
      # non-finite loss or gradient reaches a checkpoint
      for name in ("loss", "grad_norm"):
        if not math.isfinite(values[name]):
          where = f"at step {step}" + (f" (loss {values['loss']:.4g})" if name != "loss" else "")
          raise NonFiniteLossError(f"{name} is {values[name]} {where}: stopping; "
                                   f"{checkpoints.newest_note()}")
      bar.update(step, values["loss"])
      if step % config.log_every == 0 or step + 1 == config.steps:
        rates = ({} if bar.rate is None else
                 {"steps_per_s": bar.rate, "tokens_per_s": bar.rate * task.tokens_per_batch})
        writer.write(step, {**values, **rates})
      return values["loss"]

    pending, loss, eval_loss, done = None, None, None, start
    with _StopSignals() as stop:
      try:
        for step in range(start, config.steps):
          state, step_metrics = train_step(state, sharding.put_batch(_batch(task, "train", step),
                                                                     mesh))
          if pending is not None:
            loss = record(*pending)        # one step behind: the host check overlaps the next step
          pending = (step, step_metrics)
          done = step + 1
          stopping = stop.agree() is not None
          save = checkpoints.due(done) or stopping
          if done % config.eval_every == 0 or save:
            loss, pending = record(*pending), None
            with bar.paused():                  # not training time: kept out of the rates
              if done % config.eval_every == 0 or done == config.steps:
                eval_metrics = evaluate(state["params"])
                eval_loss = eval_metrics["eval_loss"]
                writer.write(step, eval_metrics)
              if save:
                checkpoints.save(done, state)
          if stopping:
            break
      finally:
        bar.close()
        checkpoints.close()              # waits for a save in flight
        writer.close()
    summary = {"final_loss": loss, "eval_loss": eval_loss, "steps_per_s": bar.rate}
    stopped = stop.agreed if done < config.steps else None
    if stopped:
      print(f"{stopped}: stopped after {done} of {config.steps} steps; checkpoint "
            f"{checkpoints.latest_step()} is saved in {checkpoints.directory}; rerun the same "
            "command to resume")
    if jax.process_index() == 0:
      if writer.path.exists():
        metrics_lib.plot_losses(writer.path, workdir / "loss.png")
      if not stopped:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return FitResult(model=model_of(state["params"]), workdir=workdir, stopped=stopped,
                     **summary)
