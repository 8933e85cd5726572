"""Memory beyond the training length (experiments.frac_memory with configs/exp_frac_extrapolate.py):
the task, the sweep order, restoring a run from its checkpoint, the arms' parameter match."""

from __future__ import annotations

import pathlib

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from experiments import common, frac_memory, memory_tasks
from neurips26_jax import train
from neurips26_jax.models.lm import LanguageModel
from neurips26_jax.train import lm_task
from neurips26_jax.train.data import synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_kv_recall_is_mqar_among_distractors():
  """The pairs and queries of mqar (same seed), and a random value token at every other
  position after the pairs; each key queried once, its value the target."""
  args = dict(seed=3, stream=0, index=2, batch=6, length=200, vocab=34, num_pairs=4)
  b = memory_tasks.kv_recall(**args)
  ref = synthetic.mqar(**args)
  np.testing.assert_array_equal(b["targets"], ref["targets"])
  np.testing.assert_array_equal(b["mask"], ref["mask"])
  queries = ref["mask"] > 0
  np.testing.assert_array_equal(b["inputs"][queries], ref["inputs"][queries])
  np.testing.assert_array_equal(b["inputs"][:, :8], ref["inputs"][:, :8])
  half = (34 - synthetic.FIRST) // 2
  rest = ~queries
  rest[:, :8] = False
  values = b["inputs"][rest]
  assert values.min() >= synthetic.FIRST + half and values.max() < 34
  assert len(np.unique(values)) == half                        # the whole value alphabet
  keys = b["inputs"][:, 0:8:2]
  for row in range(6):
    asked = b["inputs"][row][queries[row]]
    assert sorted(asked) == sorted(keys[row])                   # each key once
    assert not np.isin(b["inputs"][row][rest[row]], keys[row]).any()
  gaps = memory_tasks.mqar_gaps(b)
  np.testing.assert_array_equal(gaps, memory_tasks.mqar_gaps(ref))
  pos = np.argwhere(queries)
  for r, p in pos:
    k = list(keys[r]).index(b["inputs"][r, p])
    assert gaps[r, p] == p - (2 * k + 1)
    assert b["targets"][r, p] == b["inputs"][r, 2 * k + 1]


def _base(lrs=(0.1, 0.2, 0.4)):
  return ml_collections.ConfigDict({"optim": {"lr": 1.0}, "experiment": {"lrs": lrs}})


def test_sweep_then_seeds_order_and_best_lr(tmp_path):
  """Every arm at every rate with the first seed, then the other seeds at the arm's best
  (lowest eval_loss; a diverged run, eval_loss None, counts as worst); resumable."""
  base = _base()
  results = common.Results("sweep", directory=tmp_path)
  loss = {("a", 0.2): 1.0, ("b", 0.4): 2.0, ("b", 0.1): None}
  ran = []
  for arm, lr, seed in frac_memory.runs_of(base, ["a", "b"], [0, 1, 2], results, "t"):
    key = f"t/{common.run_key(common.run_label(base, arm, lr), seed)}"
    if not results.has(key):
      ran.append((arm, lr, seed))
      results.put(key, {"task": "t", "arm": arm, "lr": lr, "seed": seed,
                        "eval_loss": loss.get((arm, lr), 5.0)})
  assert ran[:6] == [(a, lr, 0) for a in "ab" for lr in (0.1, 0.2, 0.4)]
  assert ran[6:] == [("a", 0.2, 1), ("b", 0.4, 1), ("a", 0.2, 2), ("b", 0.4, 2)]
  assert "t/a@lr0.2/seed1" in results.runs
  best = frac_memory.rows_at_best_lr(results.runs, "t")
  assert [r["seed"] for r in best["a"]] == [0, 1, 2] and {r["lr"] for r in best["b"]} == {0.4}
  again = list(frac_memory.runs_of(base, ["a"], [0, 1], results, "t"))
  assert again == [("a", 0.1, 0), ("a", 0.2, 0), ("a", 0.4, 0), ("a", 0.2, 1)]
  no_sweep = ml_collections.ConfigDict({"optim": {"lr": 1.0}, "experiment": {}})
  assert list(frac_memory.runs_of(no_sweep, ["a", "b"], [0, 1], results, "t")) == [
      ("a", None, 0), ("b", None, 0), ("a", None, 1), ("b", None, 1)]
  assert common.run_label(no_sweep, "a", None) == "a"
  assert list(frac_memory.runs_of(_base((0.3,)), ["a"], [0], results, "t")) == [("a", 0.3, 0)]


def _config():
  from neurips26_jax.configs import exp_frac_extrapolate  # noqa: PLC0415
  return exp_frac_extrapolate.get_config()


@pytest.mark.slow
def test_runs_are_evaluated_beyond_their_length_from_their_checkpoints(tmp_path):
  """A tiny sweep: every row gets its accuracy per gap at each eval length, computed by the
  model restored from its checkpoint (not the one in memory), and its memory clocks. Slow
  (~50 s, the suite's heaviest): the sweep's order and best-lr pick stay in the default run
  (test_sweep_then_seeds_order_and_best_lr)."""
  base = _config()
  with base.unlocked():
    t = base.experiment.tasks.kv_recall
    t.length, t.steps, t.batch, t.eval_batches = 32, 2, 8, 1
    t.eval_lengths, t.extrapolate_batches = (1, 3), 1
    base.eval_batches = 1
    base.experiment.lrs = (1e-3, 2e-3)
    base.optim.warmup_steps = 1
  results = common.Results("x", directory=tmp_path)
  frac_memory.train_stage(base, ["kv_recall"], ["mamba2_ssm_init"], [0], results, tmp_path,
                          "x")
  assert sorted(results.runs) == ["kv_recall/mamba2_ssm_init@lr0.001/seed0",
                                  "kv_recall/mamba2_ssm_init@lr0.002/seed0"]
  row = results.runs["kv_recall/mamba2_ssm_init@lr0.002/seed0"]
  assert row["jax"] == jax.__version__ and row["flops_per_token"]["weights"] > 0
  at = row["extrapolation"]
  assert sorted(at) == ["1", "3"] and at["3"]["length"] == 96 and at["3"]["n"] == 8 * 4
  assert max(b["hi"] for b in at["3"]["by_gap"]) == 128
  model, _ = train.load_model(row["workdir"])
  config = frac_memory.run_config(base, "kv_recall", "mamba2_ssm_init", 0, 2e-3)
  assert frac_memory.gap_accuracy("kv_recall", t, model, config, length=96, num_batches=1) == at["3"]
  trained = jax.tree.leaves(nnx.state(model, nnx.Param))
  initial = jax.tree.leaves(nnx.state(lm_task.make_model(config), nnx.Param))
  assert any(not np.array_equal(a, b) for a, b in zip(trained, initial))
  clock = row["memory_clock"]
  assert len(clock["init"]) == len(clock["trained"]) == 2
  assert clock["init"][0]["gaps"] == [32, 128, 512]
  assert clock["trained"] == frac_memory.memory_clock(model, *_clock_batch(t, 3 * 32), [32, 128, 512])


def _clock_batch(t, length):
  from experiments import memory_tasks  # noqa: PLC0415
  from neurips26_jax.train.data import text  # noqa: PLC0415
  b = memory_tasks.kv_recall(seed=10_000, stream=text.VAL, index=0, batch=t.batch, length=length,
                             vocab=t.vocab, num_pairs=t.num_pairs, power=t.power)
  distractors = b["mask"] == 0
  distractors[:, :2 * t.num_pairs] = False
  return b["inputs"], distractors


def test_arms_are_matched_within_two_percent():
  """The four arms of configs/exp_frac_extrapolate.py: FRAC, the one-mode exponential layer
  (default and mamba_ssm init: the same shapes) and FRAC with a fixed dt (no dt_proj)."""
  base = _config()
  counts = {}
  for arm in base.experiment.order:
    c = frac_memory.run_config(base, "kv_recall", arm, 0)
    model = nnx.eval_shape(lambda: LanguageModel(**c.model.to_dict(), rngs=nnx.Rngs(0)))
    counts[arm] = common.param_count(model)
    mixer = model.blocks[0].mixer
    assert mixer.context == c.model.context == base.experiment.tasks.kv_recall.length
  assert counts["one_mode_exp"] == counts["mamba2_ssm_init"]
  assert counts["frac"] - counts["one_mode_exp"] == 2 * 4              # alpha logits
  assert counts["frac"] - counts["frac_fixed_dt"] == 2 * 64 * 4        # dt_proj
  assert max(counts.values()) / min(counts.values()) < 1.02


def test_memory_clock_of_a_one_mode_layer():
  """timescale = 1 / (A_h mean dt over the distractors); K(u)/K(0) = exp(-A_h u)."""
  base = _config()
  c = frac_memory.run_config(base, "kv_recall", "mamba2_ssm_init", 0)
  with c.unlocked():
    c.model.num_layers = 1
  model = lm_task.make_model(c)
  inputs = np.random.default_rng(0).integers(2, 34, (2, 40)).astype(np.int32)
  distractors = np.zeros(inputs.shape, bool)
  distractors[:, 10:] = True
  (layer,) = frac_memory.memory_clock(model, inputs, distractors, [5, 50])
  mixer = model.blocks[0].mixer
  x = model.blocks[0].norm1(model.embed[...][inputs])
  dt = np.asarray(jax.nn.softplus(mixer._project(x)[-1] + mixer.dt_bias[...]))
  mean_dt = dt[:, 10:].mean((0, 1))
  a = np.exp(np.asarray(mixer.log_timescale[...]))
  np.testing.assert_allclose(layer["timescale"], 1 / (a * mean_dt), rtol=1e-3, atol=0.06)
  np.testing.assert_allclose(layer["kernel_over_k0"],
                             np.exp(-a[:, None] * np.outer(mean_dt, [5, 50])), atol=1e-5)
