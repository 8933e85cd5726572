"""Progress output: steps/s and tokens/s count training steps only (evaluation and checkpoint
time left out), no rate or eta before one is measured, nothing from an inactive bar."""

import dataclasses
import time

import pytest

from neurips26_jax.train import lm_task, metrics, trainer
from neurips26_jax.train.metrics import read_metrics
from tests.test_train import compilation_cache, config  # noqa: F401 (fixtures)


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


@pytest.fixture
def clock(monkeypatch):
  c = Clock()
  monkeypatch.setattr(metrics.time, "perf_counter", c)
  return c


def test_rates_leave_out_paused_time_and_start_without_eta(clock, capsys):
  bar = metrics.ProgressBar(10, tokens_per_step=100)
  bar.update(0, 2.0)                       # the first step: compiling, not measured
  assert bar.rate is None
  first = capsys.readouterr().err.strip()
  assert first.endswith("1/10 loss 2.0000") and "eta" not in first and "/s" not in first
  for step in (1, 2):
    clock.now += 0.5                       # two training steps of 0.5 s
    bar.update(step, 1.0)
  with bar.paused():                       # an evaluation and a checkpoint: 30 s
    clock.now += 30.0
  clock.now += 0.5
  bar.update(3, 1.0)
  assert bar.rate == pytest.approx(2.0)    # 3 steps in 1.5 s of training
  last = capsys.readouterr().err.strip().splitlines()[-1]
  assert last.endswith("4/10 loss 1.0000 | 2.00 steps/s 200 tok/s | eta 3s"), last


def test_an_inactive_bar_prints_nothing_but_measures(clock, capsys):
  bar = metrics.ProgressBar(4, tokens_per_step=1, active=False)
  for step in range(3):
    clock.now += 0.25
    bar.update(step, 1.0)
  bar.close()
  assert capsys.readouterr().err == "" and bar.rate == pytest.approx(4.0)


def test_slow_evaluation_does_not_lower_the_logged_rates(tmp_path):
  """Each evaluation takes >= 2 s here, so 8 steps with two evaluations would log < 2 steps/s
  if evaluation counted; the training steps of this tiny model take milliseconds."""
  c = config()
  c.eval_batches = 1
  task = lm_task.build_task(c)

  def slow_eval_batch(i):
    time.sleep(2.0)
    return task.eval_batch(i)

  result = trainer.fit(c, tmp_path, dataclasses.replace(task, eval_batch=slow_eval_batch))
  rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "steps_per_s" in r]
  assert "steps_per_s" not in read_metrics(tmp_path / "metrics.jsonl")[0]   # not measured yet
  assert result.steps_per_s > 3 and rows[-1]["steps_per_s"] == result.steps_per_s
  assert rows[-1]["tokens_per_s"] == pytest.approx(result.steps_per_s * task.tokens_per_batch)
