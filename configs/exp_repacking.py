"""Repacking: Pack3D segmenters on the geometry task
(experiments.geometry_task: box surfaces need exact 3D neighbours, box classes come from a
marker two or more cubes away), trained on raster-zyx packing of two 8x8x8 fields per item,
evaluated under every layout of jaxops.packing and on unseen field shapes.

  python -m experiments.repacking --config=configs/exp_repacking.py

Arms differ only in the position scheme of Pack3DAttention (same local + far attention over
the true coordinates, same everything else): learned_packed (learned embedding of the packed
index), rope_packed (1D RoPE on the packed index), axial_rope (3D RoPE on the grid
coordinates), none (a control without positions).
"""

import ml_collections

from neurips26_jax.configs import lm_smoke


def get_config():
  c = lm_smoke.get_config()
  del c["sample"]
  c.steps = 500                         # ~0.7 steps/s on the shared 2-core CPU: ~12 min per arm
  c.batch_size = 8
  c.log_every = 10
  c.eval_every = 250
  c.eval_batches = 2
  c.checkpoint_every = 250
  c.keep_checkpoints = 1
  c.optim.update({"lr": 2e-3, "warmup_steps": 40, "min_lr_ratio": 0.1, "weight_decay": 0.0})
  c.data = ml_collections.ConfigDict({
      "shapes": [(8, 8, 8)], "fields_per_item": 2, "num_tokens": 1024,
      # unseen in training; each field at most 512 tokens, so two still fit in 1024
      "eval_shapes": [(6, 8, 10), (10, 10, 5), (12, 6, 6), (8, 6, 10), (6, 12, 7)]})
  c.model = ml_collections.ConfigDict({
      "d_model": 48, "depth": 3, "num_heads": 2, "d_ff": 96,
      "attention_options": {"block_shape": (2, 2, 2), "radius_blocks": 1, "max_cubes": 320}})
  c.experiment = ml_collections.ConfigDict({
      "seeds": (0,),
      "order": ("learned_packed", "rope_packed", "axial_rope", "none"),
      "arms": {"learned_packed": "learned_packed", "rope_packed": "rope_packed",
               "axial_rope": "axial_rope", "none": "none"},
      "eval_batches": 8,
  })
  return c
