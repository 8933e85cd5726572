"""Checkpoints with orbax: when to save, how many to keep, and a restore that survives damage.

Cadence and retention are orbax's own policies: a save every `every` steps and at the last step
(FixedIntervalPolicy, SpecificStepsPolicy), the newest `keep` kept (LatestN). Orbax writes each
step to a temporary directory and renames it when complete, so a run killed mid-save leaves no
half-written checkpoint under a step's name. Added here:
- `save` refuses a state holding NaN or inf (one boolean reduced on device), so every checkpoint
  on disk is finite;
- `restore_latest` skips a checkpoint that does not restore (truncated, emptied), moving it aside
  with a warning, and reports a checkpoint of another model as one UsageError.
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers as policies

from neurips26_jax.train.errors import TrainingError, UsageError


class NonFiniteStateError(TrainingError):
  """The state to be saved holds NaN or inf; nothing was saved."""


class DifferentModelError(UsageError):
  """The checkpoints hold another tree of arrays (names, shapes or dtypes) than the model."""


@jax.jit
def _all_finite(tree) -> jax.Array:
  """One boolean: every float leaf of `tree` is finite (reduced on device, one scalar fetched)."""
  flags = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.stack(flags).all() if flags else jnp.bool_(True)


def _arrays(tree, prefix: str = "") -> dict[str, tuple]:
  """{"params/layers/0/w": (shape, dtype)} for every array-like leaf of `tree`."""
  def name(key):    # dict keys, sequence indices and (named-tuple) attributes alike
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)

  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {prefix + "/".join(name(k) for k in path): (tuple(x.shape), jnp.dtype(x.dtype).name)
          for path, x in leaves}


def tree_difference(saved, wanted, prefix: str = "") -> str:
  """The first difference between two trees of arrays, in words; "" when they match. `prefix`
  goes before every name (e.g. "params/" when the trees are the params of a train state)."""
  a, b = _arrays(saved, prefix), _arrays(wanted, prefix)
  for name in sorted(a.keys() | b.keys()):
    if name not in b:
      return f"the checkpoint has {name} {a[name][0]}, which the model lacks"
    if name not in a:
      return f"the model has {name} {b[name][0]}, which the checkpoint lacks"
    if a[name] != b[name]:
      return f"{name} is {a[name][0]} {a[name][1]} in the checkpoint, {b[name][0]} {b[name][1]} in the model"
  return ""


class Checkpoints:
  """Checkpoints of a train-state pytree under `directory`."""

  def __init__(self, directory: str | pathlib.Path, *, every: int = 1, keep: int = 1,
               last: int = 1, read_only: bool = False):
    """Saves every `every` steps and at step `last`, keeping the newest `keep`; with
    `read_only`, only reads (the policies are unused, nothing is written or moved)."""
    self.directory = pathlib.Path(os.path.abspath(directory))
    self.read_only = read_only
    if read_only:           # no policy acts before a save, and this one never saves
      options = ocp.CheckpointManagerOptions(create=False)
    else:
      save_policy = policies.AnySavePolicy([policies.FixedIntervalPolicy(every),
                                            policies.SpecificStepsPolicy((last,))])
      options = ocp.CheckpointManagerOptions(
          save_decision_policy=save_policy, preservation_policy=policies.LatestN(keep),
          create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_handlers=ocp.StandardCheckpointHandler())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def due(self, step: int) -> bool:
    """Whether the policies call for a checkpoint after `step` steps (and none exists yet)."""
    return self.manager.should_save(step)

  def save(self, step: int, state) -> None:
    """Starts saving `state` as checkpoint `step` (finished by the next save or `close`).

    NonFiniteStateError, saving nothing, if any float array of `state` holds NaN or inf.
    """
    if self.read_only:
      raise RuntimeError(f"Checkpoints({self.directory}, read_only=True) cannot save")
    if not bool(_all_finite(state)):
      raise NonFiniteStateError(
          f"the parameters or optimizer state after step {step} hold NaN or inf (the loss may "
          f"still look finite): stopping without saving them; {self.newest_note()}")
    self.manager.save(step, args=ocp.args.StandardSave(state), force=True)

  def newest_note(self) -> str:
    """What a rerun resumes from, in words (true because `save` writes only finite states)."""
    newest = self.latest_step()
    if newest is None:
      return "no checkpoint was saved before it, so a rerun starts from step 0"
    return (f"the newest checkpoint, step {newest} in {self.directory}, was checked finite when "
            "saved and a rerun resumes from it")

  def restore_latest(self, like):
    """The newest checkpoint that restores, with the shapes/dtypes/shardings of `like`; or None.

    A checkpoint that cannot be read is renamed `<step>.unreadable` (orbax then ignores it; it is
    kept for inspection) with a warning, and the next older one is tried. DifferentModelError
    if a readable checkpoint holds other arrays than `like`.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        metadata = self.manager.item_metadata(step)
        if not metadata:
          raise ValueError("its metadata is missing")
        if difference := tree_difference(metadata, abstract):
          raise DifferentModelError(difference)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))
      except DifferentModelError:
        raise
      except Exception as e:  # noqa: BLE001  (any failure to read means: try an older one)
        self._set_aside(step, e)
    return None

  def restore_params(self, like, step: int | None = None):
    """-> (step, params): the "params" entry of checkpoint `step` (None: the newest one that
    restores, skipping unreadable ones with a warning), with the shapes/dtypes/shardings of
    `like` (the model's nnx.State of Params); the step counter and optimizer state are not read.
    UsageError for a step that is not there or does not restore; DifferentModelError if the
    checkpoint holds other parameters than `like`."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    steps = sorted(self.manager.all_steps(), reverse=True)
    if step is not None and step not in steps:
      raise UsageError(f"no checkpoint at step {step} in {self.directory}; the steps saved "
                       f"are {sorted(steps) or 'none'} (a run keeps only its newest "
                       "config.keep_checkpoints checkpoints)")
    for candidate in [step] if step is not None else steps:
      try:
        metadata = self.manager.item_metadata(candidate)
        if not metadata or "params" not in metadata:
          raise ValueError("its metadata is missing")
        if difference := tree_difference(metadata["params"], abstract, prefix="params/"):
          raise DifferentModelError(difference)
        target = {"params": abstract}
        restored = ocp.PyTreeCheckpointer().restore(
            self.directory / str(candidate) / "default",     # the manager's one item
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))
        return candidate, restored["params"]
      except DifferentModelError:
        raise
      except Exception as e:  # noqa: BLE001  (any failure to read means: try an older one)
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        if step is not None:
          raise UsageError(f"checkpoint {step} in {self.directory} does not restore "
                           f"({reason})") from None
        logging.warning("checkpoint %d does not restore (%s); trying the next older one",
                        candidate, reason)
    raise UsageError(f"no checkpoint in {self.directory} restores (steps found: "
                     f"{sorted(steps) or 'none'})")

  def _set_aside(self, step: int, error: Exception) -> None:
    path = self.directory / str(step)
    aside = path.with_name(f"{step}.unreadable")
    n = 1
    while aside.exists():
      aside, n = path.with_name(f"{step}.unreadable{n}"), n + 1
    if jax.process_index() == 0:
      path.rename(aside)
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    logging.warning("checkpoint %d does not restore (%s: %s); moved it to %s and trying the "
                    "next older one", step, type(error).__name__, reason, aside)
    self.manager.reload()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
