"""Byte-level Tiny Shakespeare at nanoGPT's CPU budget, five arms with
parameters matched within 2% of attention + SwiGLU, three seeds each.

  python -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py

Budget (nanoGPT's CPU recipe): 2000 steps, batch 12, context 64, d=128, 4 layers, 4 heads,
~0.86M parameters. Validation: the whole last 10% of the file, every character scored once
(experiments.lm_shakespeare.whole_split_loss), in nats per character. The optimizer is
lm_default's (AdamW, lr 3e-3, 60 warmup steps, cosine to 0.1x), the same for every arm.
Parameter matching: FRAC's mixer has ~11k fewer parameters per layer than attention
(input projections 128x292 in all + out_proj 128x128 vs 4 x 128^2), so the FRAC and Mamba-2 arms get that
back in their FFN (SwiGLU d_ff 373 instead of 344; FlashFFN d_e 144 instead of 128).
"""

import ml_collections

from neurips26_jax.configs import lm_default

_SSM = {"head_dim": 32, "state_dim": 16, "chunk": 64}


def get_config():
  c = lm_default.get_config()
  c.steps = 2000
  c.batch_size = 12
  c.log_every = 10
  c.eval_every = 500
  c.eval_batches = 8                 # the trainer's sampled estimate; the reported number is
  c.checkpoint_every = 500           # the whole-split loss computed after training
  c.keep_checkpoints = 1
  c.data.path = "data/tinyshakespeare.txt"
  c.data.val_fraction = 0.1
  c.data.max_bytes = 0
  c.model.update({"context": 64, "impl": "xla", "d_model": 128, "num_layers": 4,
                  "num_heads": 4})
  c.sample.num_tokens = 0
  arm = lambda mixer, ffn, mixer_options, ffn_options: ml_collections.ConfigDict(
      {"mixer": mixer, "ffn": ffn, "mixer_options": mixer_options, "ffn_options": ffn_options})
  c.experiment = ml_collections.ConfigDict({
      "seeds": (0, 1, 2),
      "reference_arm": "attention_swiglu",
      "order": ("attention_swiglu", "attention_flashffn", "frac_swiglu", "frac_flashffn",
                "mamba2_swiglu"),
      "param_tolerance": 0.02,
      "eval_batch": 128,              # windows per forward in the whole-split evaluation
      "arms": {
          "attention_swiglu": arm("attention", "swiglu", {}, {"d_ff": 344}),
          "attention_flashffn": arm("attention", "flashffn", {},
                                    {"num_heads": 4, "num_experts": 2, "d_expert": 128}),
          "frac_swiglu": arm("frac", "swiglu", _SSM, {"d_ff": 373}),
          "frac_flashffn": arm("frac", "flashffn", _SSM,
                               {"num_heads": 4, "num_experts": 2, "d_expert": 144}),
          "mamba2_swiglu": arm("mamba2", "swiglu", _SSM, {"d_ff": 373}),
      },
      "throughput_steps": 50,         # timed train steps per arm and round (after warm-up)
      "throughput_rounds": 2,
      "nanogpt_reference": {"val_loss": 1.898, "tokens_per_s": 9600},
  })
  return c
