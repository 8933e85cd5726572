"""Cell segmentation: Pack3DSegmenter (axial RoPE, Pack3D attention, FlashFFN) on packed
procedural cell volumes of different shapes; --config.model.kind=unet3d for the size-matched
3D U-Net baseline. Compare eval_dice in metrics.jsonl. Sized for an accelerator (about
100 s per step on a 2-core CPU; use configs/seg3d_smoke.py there).

  neurips26-train-seg3d --config=seg3d_cells --workdir=runs/seg3d_pack3d
"""

import ml_collections

from neurips26_jax.configs import seg3d_smoke


def get_config():
  c = seg3d_smoke.get_config()
  c.steps = 2000
  c.batch_size = 8
  c.log_every = 10
  c.eval_every = 200
  c.eval_batches = 4
  c.checkpoint_every = 200
  c.optim.update({"lr": 1e-3, "warmup_steps": 100})
  c.data = ml_collections.ConfigDict({
      "shapes": [(32, 32, 32), (24, 32, 48), (32, 48, 32), (16, 32, 32), (48, 32, 32)],
      "patch": (4, 4, 4), "fields_per_item": 4, "num_tokens": 4 * 768})
  c.model = ml_collections.ConfigDict({
      "kind": "pack3d", "d_model": 96, "depth": 4, "num_heads": 4, "ffn": "flashffn",
      "ffn_options": {"num_heads": 4, "num_experts": 2, "d_expert": 64},
      "attention_options": {"block_shape": (4, 4, 4), "radius_blocks": 1,
                            "position": "axial_rope"},
      "impl": "auto", "unet": {"base_channels": 0, "levels": 3}})
  return c
