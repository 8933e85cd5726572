"""The trainer on the byte-level LM: sharding, resume, NaN stop, bad configs, the binary."""

import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.configs import lm_smoke
from neurips26_jax.train import lm_task, trainer
from neurips26_jax.train.metrics import read_metrics


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
  """Runs of the same config compile the same programs: cache them for the modules that use
  this fixture (one directory for the session, so tests/test_trainer_crash.py hits it too)."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = [getattr(jax.config, n) for n in names]
  cache = tmp_path_factory.getbasetemp() / "trainer_jax_cache"
  cache.mkdir(exist_ok=True)
  new = [str(cache), 0.0, 0]
  for n, v in zip(names, new):
    jax.config.update(n, v)
  yield
  for n, v in zip(names, old):
    jax.config.update(n, v)


def config(**mesh):
  c = lm_smoke.get_config()
  c.steps, c.checkpoint_every, c.eval_every, c.eval_batches = 8, 4, 4, 1
  c.data.max_bytes = 100_000
  c.optim.warmup_steps = 2
  c.model.context = 16
  c.model.d_model, c.model.ffn_options = 16, {"d_ff": 32}
  c.mesh.update(mesh or {"data": 1, "fsdp": 1, "tensor": 1})
  return c


def losses(workdir):
  return [r["loss"] for r in read_metrics(pathlib.Path(workdir) / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """One uninterrupted single-device run shared by the comparisons below."""
  workdir = tmp_path_factory.mktemp("baseline")
  c = config()
  result = trainer.fit(c, workdir, lm_task.build_task(c))
  return workdir, result


def test_run_outputs(baseline):
  workdir, result = baseline
  rows = read_metrics(workdir / "metrics.jsonl")
  assert [r["step"] for r in rows if "loss" in r] == list(range(8))
  assert [r["step"] for r in rows if "eval_loss" in r] == [3, 7]
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4", "8"]
  assert (workdir / "loss.png").stat().st_size > 0 and any((workdir / "tb").iterdir())
  assert np.isfinite(result.final_loss) and result.final_loss < losses(workdir)[0]


def test_sharded_2x2x2_equals_one_device(baseline, tmp_path):
  c = config(data=2, fsdp=2, tensor=2)
  trainer.fit(c, tmp_path, lm_task.build_task(c))
  np.testing.assert_allclose(losses(tmp_path), losses(baseline[0]), rtol=2e-5)


@pytest.mark.slow
def test_sharded_pallas_flashffn_equals_one_device(tmp_path):
  """Training through FlashFFN's Pallas kernel under shard_map equals one device (~1 min)."""
  runs = []
  for name, mesh in (("one", {}), ("mesh", {"data": 2, "fsdp": 2, "tensor": 2})):
    c = config(**mesh)
    c.steps = 3
    c.model.ffn, c.model.impl = "flashffn", "pallas"
    c.model.ffn_options = {"num_experts": 2, "d_expert": 8, "num_heads": 2}
    trainer.fit(c, tmp_path / name, lm_task.build_task(c))
    runs.append(losses(tmp_path / name))
  np.testing.assert_allclose(runs[1], runs[0], rtol=2e-5)


def test_stop_and_resume_equals_uninterrupted(baseline, tmp_path):
  c = config()
  task = lm_task.build_task(c)

  def preempted(step):
    if step == 6:
      raise KeyboardInterrupt("preempted")
    return task.train_batch(step)

  with pytest.raises(KeyboardInterrupt):
    trainer.fit(c, tmp_path, dataclasses.replace(task, train_batch=preempted))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]
  (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-0").mkdir()   # a save cut short
  resumed = trainer.fit(c, tmp_path, task)
  assert losses(tmp_path) == losses(baseline[0])
  # bit-identical parameters, not only losses
  chex.assert_trees_all_equal(nnx.state(resumed.model, nnx.Param),
                              nnx.state(baseline[1].model, nnx.Param))


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(baseline, tmp_path):
  c = config()
  task = lm_task.build_task(c)
  poisoned = dataclasses.replace(
      task,
      train_batch=lambda s: {**task.train_batch(s), "poison": np.full(8, np.nan if s == 5 else 0, np.float32)},
      loss_fn=lambda m, b: (task.loss_fn(m, b)[0] + jnp.mean(b.get("poison", 0.0)), {}))
  with pytest.raises(trainer.NonFiniteLossError, match="at step 5"):
    trainer.fit(c, tmp_path, poisoned)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4"]
  trainer.fit(c, tmp_path, task)          # resumes from the good checkpoint
  assert losses(tmp_path) == losses(baseline[0])


@pytest.mark.parametrize("field, value, message", [
    ("model.mixer", "lstm", "config.model"),
    ("mesh.tensor", 3, "config.mesh.tensor"),
    ("mesh.data", -2, "config.mesh.data"),
    ("batch_size", 6, "config.batch_size"),
    ("optim.lr", -1.0, "config.optim.lr"),
    ("optim.warmup_steps", -1, "config.optim.warmup_steps"),
    ("compute_dtype", "float8", "config.compute_dtype"),
    ("steps", 0, "config.steps"),
    ("sample.num_tokens", 100, "config.sample.num_tokens"),
])
def test_bad_config_fails_before_compiling_naming_the_field(tmp_path, field, value, message):
  c = config(data=2, fsdp=2, tensor=2) if field == "batch_size" else config()
  *parents, leaf = field.split(".")
  node = c
  for p in parents:
    node = node[p]
  node[leaf] = value
  with pytest.raises(ValueError, match=message):
    lm_task.train_and_evaluate(c, str(tmp_path))
  assert not (tmp_path / "checkpoints").exists()


def test_synthetic_task_trains_with_masked_loss_and_accuracy(tmp_path):
  c = config()
  c.steps, c.eval_every = 2, 2
  c.data.kind, c.data.vocab, c.data.options = "mqar", 16, {"num_pairs": 2}
  trainer.fit(c, tmp_path, lm_task.build_task(c))
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert "accuracy" in rows[0] and 0 <= rows[-1]["eval_accuracy"] <= 1


def test_bad_synthetic_options_name_the_field(tmp_path):
  c = config()
  c.data.kind, c.data.vocab, c.data.options = "mqar", 16, {"num_pairs": 50}
  with pytest.raises(ValueError, match="config.data.options"):
    lm_task.build_task(c)
