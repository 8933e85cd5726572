"""Checkpoints with orbax: save every k steps, keep the newest few, restore the newest.

Orbax writes each step to a temporary directory and renames it when complete, so a run killed
mid-save leaves no half-written checkpoint that `restore_latest` could pick up.
"""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpoints:
  """Checkpoints of a train-state pytree under `directory`."""

  def __init__(self, directory: str | pathlib.Path, *, every: int, keep: int):
    self.every = every
    self.manager = ocp.CheckpointManager(
        pathlib.Path(directory).absolute(),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore_latest(self, like):
    """The newest checkpoint restored with the shapes/dtypes/shardings of `like`, or None."""
    step = self.manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def due(self, step: int, last: int) -> bool:
    return step % self.every == 0 or step == last

  def save(self, step: int, state) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state), force=True)

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
