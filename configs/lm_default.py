"""The main job: a byte-level LM with FRAC mixers and FlashFFN on the Python stdlib source.

About 3 minutes on a 2-core CPU (`make demo`):
  neurips26-train-lm --config=lm_default --workdir=runs/lm_default
Baseline variants: --config.model.ffn=swiglu --config.model.ffn_options='{}' (SwiGLU then
takes FlashFFN's parameter count, LanguageModel's rule), --config.model.mixer=mamba2.
"""

import ml_collections

from neurips26_jax.configs import lm_smoke


def get_config():
  c = lm_smoke.get_config()
  c.steps = 900                         # ~5.5 steps/s on an idle 2-core CPU
  c.batch_size = 8
  c.eval_every = 150
  c.eval_batches = 8
  c.checkpoint_every = 150
  c.optim.update({"lr": 3e-3, "warmup_steps": 60, "min_lr_ratio": 0.1})
  c.data.max_bytes = 0                  # the whole stdlib corpus
  c.model = ml_collections.ConfigDict({
      "vocab_size": 256, "d_model": 128, "num_layers": 4, "num_heads": 4, "context": 128,
      "mixer": "frac", "ffn": "flashffn",
      "mixer_options": {"head_dim": 32, "state_dim": 16, "chunk": 32},
      "ffn_options": {"num_heads": 4, "num_experts": 2, "d_expert": 64},
      "impl": "auto", "remat": "none"})   # "full" / "mixer": recomputed in the backward (models.lm)
  c.sample = ml_collections.ConfigDict({"prompt": "def ", "num_tokens": 300, "temperature": 0.7})
  return c
