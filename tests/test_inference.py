"""From a run's workdir back to its model, in process: train.load_model rebuilds the model from
config.json and a checkpoint's parameters (the newest good one, or a chosen step), and
train.evaluate on it gives the evaluation loss the trainer logged; for the language model and
the 3D segmenter."""

import json
import shutil

import chex
import numpy as np
import pytest
from flax import nnx

from neurips26_jax import train
from neurips26_jax.configs import seg3d_smoke
from neurips26_jax.models import LanguageModel, Pack3DSegmenter
from neurips26_jax.train import inference, lm_task, seg3d_task, trainer
from neurips26_jax.train.errors import UsageError
from neurips26_jax.train.metrics import read_metrics
from tests.test_train import baseline, compilation_cache, config  # noqa: F401 (fixtures)
from tests.test_trainer_crash import damage


def params(model):
  return nnx.state(model, nnx.Param)


def logged_eval_loss(workdir, after_steps):
  """The eval_loss the trainer logged after `after_steps` steps (its row's step is one less)."""
  rows = read_metrics(workdir / "metrics.jsonl")
  return next(r["eval_loss"] for r in rows if "eval_loss" in r and r["step"] == after_steps - 1)


def test_load_model_is_the_trained_model(baseline):
  workdir, result = baseline
  model, c = train.load_model(workdir)
  assert isinstance(model, LanguageModel)
  assert c.to_dict() == json.loads((workdir / "config.json").read_text())
  chex.assert_trees_all_equal(params(model), params(result.model))
  np.testing.assert_allclose(train.evaluate(model, c)["eval_loss"], result.eval_loss, rtol=1e-6)
  c.sample.num_tokens = 8
  assert lm_task.sample(model, c) == lm_task.sample(result.model, c)


def test_load_model_at_a_chosen_step(baseline):
  workdir, result = baseline
  model, c, step = inference.load(workdir, step=4)
  assert step == 4
  np.testing.assert_allclose(train.evaluate(model, c)["eval_loss"],
                             logged_eval_loss(workdir, 4), rtol=1e-6)
  with pytest.raises(UsageError, match=r"no checkpoint at step 5 .* saved are \[4, 8\]"):
    train.load_model(workdir, step=5)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_is_skipped_and_left_alone(baseline, tmp_path):
  shutil.copytree(baseline[0], tmp_path, dirs_exist_ok=True)
  damage(tmp_path / "checkpoints" / "8", "truncated")
  model, c, step = inference.load(tmp_path)
  assert step == 4
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "8"]
  with pytest.raises(UsageError, match="checkpoint 8 .* does not restore"):
    train.load_model(tmp_path, step=8)


def test_another_model_or_no_run_is_one_sentence(baseline, tmp_path):
  workdir, _ = baseline
  other = config()
  other.model.d_model, other.model.ffn_options = 32, {"d_ff": 64}
  with pytest.raises(UsageError, match=r"params/.* is \(\d+, 16\) float32 in the checkpoint, "
                                       r"\(\d+, 32\) float32 in the model"):
    train.load_model(workdir, config=other)
  with pytest.raises(UsageError, match="cannot read .*config.json"):
    train.load_model(tmp_path)
  (tmp_path / "config.json").write_text((workdir / "config.json").read_text())
  with pytest.raises(UsageError, match="no checkpoints/ in it"):
    train.load_model(tmp_path)


def test_a_mesh_this_machine_cannot_hold_falls_back_to_one_device(baseline, tmp_path):
  shutil.copytree(baseline[0], tmp_path, dirs_exist_ok=True)
  saved = json.loads((tmp_path / "config.json").read_text())
  saved["mesh"] = {"data": 16, "fsdp": 1, "tensor": 1}        # the suite has 8 devices
  (tmp_path / "config.json").write_text(json.dumps(saved))
  model, c = train.load_model(tmp_path)
  assert c.mesh.to_dict() == inference.SINGLE_DEVICE
  chex.assert_trees_all_equal(params(model), params(baseline[1].model))


def test_load_model_for_the_3d_segmenter(tmp_path):
  c = seg3d_smoke.get_config()
  c.steps, c.eval_every, c.checkpoint_every, c.eval_batches, c.batch_size = 2, 2, 2, 1, 2
  c.mesh.data = 2
  result = trainer.fit(c, tmp_path, seg3d_task.build_task(c))
  model, loaded = train.load_model(tmp_path)
  assert isinstance(model, Pack3DSegmenter)
  assert loaded.data.patch == (4, 4, 4) and loaded.data.shapes[0] == (16, 16, 16)
  chex.assert_trees_all_equal(params(model), params(result.model))
  metrics = train.evaluate(model, loaded)
  np.testing.assert_allclose(metrics["eval_loss"], result.eval_loss, rtol=1e-6)
  assert 0 <= metrics["eval_dice"] <= 1
