"""Pack3DSegmenter, UNet3D and the 3D segmentation training binary."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import seg3d_smoke
from models.seg3d import Pack3DSegmenter, voxel_logits
from models.unet3d import UNet3D, param_count, unet3d_matching
from train import seg3d_task, trainer
from train.data import volumes
from train.metrics import read_metrics
from tests import binaries


RNGS = lambda: nnx.Rngs(jax.random.key(0, impl="rbg"))   # fast-compiling init


@functools.cache
def segmenter():
  return Pack3DSegmenter(num_classes=4, d_model=12, depth=1, num_heads=2,
                         ffn_options={"d_ff": 24}, attention_options={"block_shape": (2, 2, 2)},
                         impl="xla", rngs=RNGS())


def test_segmenter_is_invariant_to_the_packing_order():
  fields = volumes.sample_fields(seed=0, stream=0, index=0, count=2, shapes=[(8, 8, 12)])
  b = volumes.pack(fields, items=1, patch=(4, 4, 4), num_tokens=32)    # 24 + 8 padding
  model = segmenter()
  args = (b["tokens"], b["coords"], b["field_ids"])
  logits = model(*args)
  assert logits.shape == (1, 32, 64, 4)
  perm = np.random.default_rng(0).permutation(32)
  shuffled = model(*(a[:, perm] for a in args))
  np.testing.assert_allclose(shuffled, logits[:, perm], atol=1e-5)
  vols = voxel_logits(logits[0], [(8, 8, 12)] * 2, (4, 4, 4))
  assert [v.shape for v in vols] == [(8, 8, 12, 4)] * 2
  # voxel_logits inverts the packing: label tokens -> label volumes
  labels = voxel_logits(jnp.asarray(b["labels"][0])[..., None], [(8, 8, 12)] * 2, (4, 4, 4))
  np.testing.assert_array_equal(labels[1][..., 0], fields[1][1])


def test_unet_shapes_and_size_matching():
  model = UNet3D(num_classes=4, base_channels=4, levels=2, rngs=RNGS())
  assert model(jnp.ones((1, 8, 8, 12, 1))).shape == (1, 8, 8, 12, 4)
  with pytest.raises(ValueError, match="divisible"):
    model(jnp.ones((1, 7, 8, 8, 1)))
  target = param_count(segmenter())
  base = unet3d_matching(target, levels=2, num_classes=4)
  matched = param_count(nnx.eval_shape(lambda: UNet3D(num_classes=4, base_channels=base,
                                                      levels=2, rngs=nnx.Rngs(0))))
  assert abs(matched - target) / target < 0.25


def test_unet_training_reports_loss_and_dice(tmp_path):
  """(Pack3DSegmenter training runs in test_binary_one_step.)"""
  c = seg3d_smoke.get_config()
  c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 2, 2, 2, 2
  c.mesh.data = 2
  c.model.kind = "unet3d"
  trainer.fit(c, tmp_path, seg3d_task.build_task(c))
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert np.isfinite(rows[-1]["eval_loss"]) and 0 <= rows[-1]["eval_dice"] <= 1


@pytest.mark.parametrize("field, value, message", [
    ("model.kind", "vit", "config.model.kind"),
    ("model.num_heads", 5, "config.model"),
    ("data.num_tokens", 8, "config.data")])
def test_bad_config_names_the_field(field, value, message):
  c = seg3d_smoke.get_config()
  section, leaf = field.split(".")
  c[section][leaf] = value
  with pytest.raises(ValueError, match=message):
    seg3d_task.build_task(c)


def test_binary_one_step(tmp_path):
  binaries.run_one_step("train.train_seg3d", "configs/seg3d_smoke.py", tmp_path)
  assert (tmp_path / "checkpoints" / "1").is_dir() and (tmp_path / "loss.png").exists()
  assert "eval_dice" in read_metrics(tmp_path / "metrics.jsonl")[-1]


@pytest.mark.slow
def test_sharded_pallas_pack3d_equals_one_device(tmp_path):
  """Pack3D's Pallas kernel under shard_map (2x2x2 mesh) trains like one device (~1 min)."""
  runs = []
  for name, mesh in (("one", dict(data=1, fsdp=1, tensor=1)),
                     ("mesh", dict(data=2, fsdp=2, tensor=2))):
    c = seg3d_smoke.get_config()
    c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 2, 2, 2, 4
    c.model.impl = "pallas"
    c.mesh.update(mesh)
    trainer.fit(c, tmp_path / name, seg3d_task.build_task(c))
    runs.append([r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r])
  np.testing.assert_allclose(runs[1], runs[0], rtol=2e-5)
