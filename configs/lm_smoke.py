"""Tiny byte-level LM for tests and smoke runs (a fraction of a second per step on CPU).

  neurips26-train-lm --config=lm_smoke --workdir=/tmp/lm_smoke
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.steps = 20
  c.batch_size = 8
  c.compute_dtype = "float32"        # "bfloat16": bf16 compute, float32 parameters
  c.log_every = 1
  c.eval_every = 10
  c.eval_batches = 2
  c.checkpoint_every = 10
  c.keep_checkpoints = 3
  c.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.optim = ml_collections.ConfigDict({
      "lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1,
      "b1": 0.9, "b2": 0.95, "clip_norm": 1.0})
  c.data = ml_collections.ConfigDict({
      "kind": "text", "path": "", "max_bytes": 1_000_000, "val_fraction": 0.05,
      "vocab": 256, "options": {}})    # vocab, options: for the synthetic kinds
  c.model = ml_collections.ConfigDict({
      "vocab_size": 256, "d_model": 32, "num_layers": 2, "num_heads": 2, "context": 32,
      "mixer": "attention", "ffn": "swiglu",
      "mixer_options": {}, "ffn_options": {"d_ff": 64}, "impl": "auto",
      "remat": "none"})   # "full" / "mixer": recomputed in the backward (long contexts; models.lm)
  c.sample = ml_collections.ConfigDict({"prompt": "def ", "num_tokens": 16, "temperature": 0.0})
  return c
