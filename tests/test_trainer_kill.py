"""A real training process (the train_lm binary) signalled from outside twice, the second time
in the middle of a checkpoint save, then rerun to the end: each signal saves the step under way
and exits 0 without a traceback, the save in flight is completed, and the three processes
together leave one run's metrics, TensorBoard events and checkpoints. The same logic is tested
in process, fast, in tests/test_trainer_crash.py."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from neurips26_jax.configs import lm_smoke
from neurips26_jax.train import lm_task, trainer
from neurips26_jax.train.metrics import read_metrics
from tests.binaries import REPO
from tests.test_trainer_crash import tensorboard_events, tensorboard_scalars

STEPS = 30
OVERRIDES = {"steps": STEPS, "checkpoint_every": 10, "eval_every": 10, "eval_batches": 1,
             "keep_checkpoints": 5, "sample.num_tokens": 0, "data.max_bytes": 100_000,
             "model.context": 16, "model.d_model": 16, "mesh.data": 1}


def command(workdir, *, slow: bool):
  binary = "neurips26_jax.train.train_lm"
  module = ["-m", "tests.slow_binary", binary] if slow else ["-m", binary]
  return [sys.executable, *module, "--config=configs/lm_smoke.py", f"--workdir={workdir}",
          "--config.model.ffn_options={'d_ff': 32}",
          *(f"--config.{k}={v}" for k, v in OVERRIDES.items())]


def start(workdir, cache, **slow_s):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",       # one CPU device
         "JAX_COMPILATION_CACHE_DIR": str(cache),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         **{f"SLOW_{k.upper()}": str(v) for k, v in slow_s.items()}}
  return subprocess.Popen(command(workdir, slow=bool(slow_s)), cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(condition, process, timeout=240):
  end = time.monotonic() + timeout
  while not condition():
    assert process.poll() is None, f"exited early: {process.communicate()}"
    assert time.monotonic() < end, "timed out"
    time.sleep(0.02)


def logged_steps(workdir):
  path = workdir / "metrics.jsonl"
  return [r["step"] for r in read_metrics(path) if "loss" in r] if path.exists() else []


def finish(process):
  out, err = process.communicate(timeout=240)
  assert process.returncode == 0 and "Traceback" not in out + err, err[-3000:]
  return out + err


def steps_on_disk(workdir):
  names = [p.name for p in (workdir / "checkpoints").iterdir()]
  assert all(n.isdigit() for n in names), names           # no temporary folder left
  return sorted(int(n) for n in names)


@pytest.mark.slow
def test_killed_twice_once_mid_save_then_resumed(tmp_path):
  workdir, cache = tmp_path / "run", tmp_path / "cache"
  # 1. SIGINT (Ctrl-C) mid-run, after the checkpoint at 10
  p = start(workdir, cache, step_s=0.1)
  wait_for(lambda: len(logged_steps(workdir)) >= 13, p)
  p.send_signal(signal.SIGINT)
  assert "SIGINT: stopped after" in finish(p)
  first = logged_steps(workdir)
  assert first == list(range(len(first))) and steps_on_disk(workdir) == [10, len(first)]
  assert tensorboard_scalars(workdir / "tb")["loss"] == first    # nothing lost in a buffer

  # 2. SIGTERM while the checkpoint at 20 sits in its temporary folder
  p = start(workdir, cache, step_s=0.2, save_s=2)
  temporary = lambda: any("tmp" in n.name for n in (workdir / "checkpoints").iterdir())
  wait_for(temporary, p)
  p.send_signal(signal.SIGTERM)
  # checkpoint 20 is completed, and the step under way when the signal came is saved too
  second = int(re.search(r"SIGTERM: stopped after (\d+) of 30 steps", finish(p))[1])
  assert 20 < second < STEPS and steps_on_disk(workdir) == [10, len(first), 20, second]
  assert logged_steps(workdir) == list(range(second))

  # 3. the rerun resumes there and ends where an uninterrupted run does
  assert f"Resuming from the checkpoint at step {second}" in finish(start(workdir, cache))
  assert steps_on_disk(workdir)[-1] == STEPS
  assert logged_steps(workdir) == list(range(STEPS))
  events = tensorboard_scalars(workdir / "tb")
  assert sorted(events["loss"]) == list(range(STEPS)) and events["eval_loss"] == [9, 19, 29]
  restarts = [e.step for e in tensorboard_events(workdir / "tb") if e.HasField("session_log")]
  assert restarts == [len(first), second]

  c = lm_smoke.get_config()
  c.model.ffn_options = {"d_ff": 32}
  for key, value in OVERRIDES.items():
    *parents, leaf = key.split(".")
    node = c
    for name in parents:
      node = node[name]
    node[leaf] = value
  trainer.fit(c, tmp_path / "uninterrupted", lm_task.build_task(c))
  loss = lambda w: [r["loss"] for r in read_metrics(w / "metrics.jsonl") if "loss" in r]
  np.testing.assert_allclose(loss(workdir), loss(tmp_path / "uninterrupted"), rtol=1e-5)
