"""Tiny 3D segmentation run for tests and smoke runs (Pack3DSegmenter, two fields per item).

  neurips26-train-seg3d --config=seg3d_smoke --workdir=/tmp/seg3d_smoke
"""

import ml_collections

from neurips26_jax.configs import lm_smoke


def get_config():
  c = lm_smoke.get_config()                # the trainer fields (steps, optim, mesh, ...)
  del c["sample"]
  c.steps = 10
  c.eval_every = 5
  c.checkpoint_every = 5
  c.optim.update({"lr": 2e-3, "warmup_steps": 2})
  c.data = ml_collections.ConfigDict({
      "shapes": [(16, 16, 16), (16, 16, 24), (8, 16, 16)],   # voxel shapes of the fields
      "patch": (4, 4, 4), "fields_per_item": 2, "num_tokens": 192})
  c.model = ml_collections.ConfigDict({
      "kind": "pack3d", "d_model": 24, "depth": 1, "num_heads": 2, "ffn": "swiglu",
      "ffn_options": {"d_ff": 48}, "attention_options": {"block_shape": (2, 2, 2)},
      "impl": "auto", "unet": {"base_channels": 0, "levels": 2}})
  return c
