"""3D segmentation of procedural cell volumes at CPU size.

  python -m experiments.seg3d_cpu --config=configs/exp_seg3d_cpu.py

Volumes of 16-24 voxels per side (train.data.volumes), 2 per packed item, patch 2^3 (so
8-12 tokens per side, cubes of 2^3 tokens: 4-6 cubes per side, the local branch sees the
3^3 cubes around a query, the far branch the rest of the field). Held-out volumes: the
evaluation stream (never trained on). Macro Dice over the three foreground classes.

Arms (everything else equal: d=48, 3 blocks, 2 heads, SwiGLU d_ff 128, XLA path):
  pack3d_axial_rope   Pack3D (local + far summaries, one softmax), axial RoPE
  pack3d_learned      the same attention with learned positions (the paper's matched baseline)
  local_only          axial RoPE, local branch only (merge="local")
  unet3d              a 3D U-Net (3 levels) with base_channels matched to Pack3D's parameters
  rope_after          ablation: RoPE applied after compression (rotate_summaries="after")
  no_block_bias       ablation: no log(n_b) bias on the summary logits
"""

import ml_collections

from neurips26_jax.configs import seg3d_smoke


def get_config():
  c = seg3d_smoke.get_config()
  c.steps = 300                         # ~2 s/step on the shared 2-core CPU: ~10 min per arm
  c.batch_size = 4
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 4                    # 4 x 4 items x 2 fields = 32 held-out volumes
  c.checkpoint_every = 100
  c.keep_checkpoints = 1
  c.optim.update({"lr": 2e-3, "warmup_steps": 30, "min_lr_ratio": 0.1, "weight_decay": 0.05})
  c.data = ml_collections.ConfigDict({
      "shapes": [(16, 16, 16), (16, 16, 24), (24, 16, 16), (16, 24, 16), (24, 24, 16)],
      "patch": (2, 2, 2), "fields_per_item": 2, "num_tokens": 2304})
  attention = {"block_shape": (2, 2, 2), "radius_blocks": 1, "position": "axial_rope",
               "max_cubes": 640}
  c.model = ml_collections.ConfigDict({
      "kind": "pack3d", "d_model": 48, "depth": 3, "num_heads": 2, "ffn": "swiglu",
      "ffn_options": {"d_ff": 128}, "attention_options": attention,
      "impl": "xla", "unet": {"base_channels": 0, "levels": 3}})
  c.experiment = ml_collections.ConfigDict({
      "seeds": (0, 1, 2),
      "order": ("pack3d_axial_rope", "pack3d_learned", "local_only", "unet3d", "rope_after",
                "no_block_bias"),
      "arms": {
          "pack3d_axial_rope": {},
          "pack3d_learned": {"attention_options": {"position": "learned_packed",
                                                   "max_len": 2304}},
          "local_only": {"attention_options": {"merge": "local"}},
          "unet3d": {"kind": "unet3d"},
          "rope_after": {"attention_options": {"rotate_summaries": "after"}},
          "no_block_bias": {"attention_options": {"block_bias": False}},
      },
  })
  return c
