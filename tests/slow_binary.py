"""`python -m tests.slow_binary MODULE FLAGS...`: run a training binary slowed down so that a test
can signal it at a chosen moment: each training batch takes SLOW_STEP_S seconds longer, and each
checkpoint stays in its temporary folder SLOW_SAVE_S seconds before orbax's final rename."""

import asyncio
import dataclasses
import os
import runpy
import sys
import time

from orbax.checkpoint._src.path import atomicity

from neurips26_jax.train import trainer

STEP_S = float(os.environ.get("SLOW_STEP_S", "0"))
SAVE_S = float(os.environ.get("SLOW_SAVE_S", "0"))

_finalize = atomicity.AtomicRenameTemporaryPath.finalize
_fit = trainer.fit


async def _slow_finalize(self, *args, **kwargs):
  await asyncio.sleep(SAVE_S)
  return await _finalize(self, *args, **kwargs)


def _slow_fit(config, workdir, task):
  def train_batch(step):
    time.sleep(STEP_S)
    return task.train_batch(step)
  return _fit(config, workdir, dataclasses.replace(task, train_batch=train_batch))


if __name__ == "__main__":
  atomicity.AtomicRenameTemporaryPath.finalize = _slow_finalize
  trainer.fit = _slow_fit
  module = sys.argv.pop(1)
  runpy.run_module(module, run_name="__main__", alter_sys=True)
