"""MQAR (multi-query associative recall) with power-law gaps: 64 key-value pairs in 512 tokens.

  neurips26-train-lm --config=lm_mqar --workdir=runs/mqar_frac
  ... --config.model.mixer=attention --config.model.mixer_options='{}'   (the attention reference)
Other tasks: --config.data.kind=lag_recall --config.data.options='{}', or
--config.data.kind=selective_copy --config.data.options='{"num_tokens": 16}'.
"""

import ml_collections

from neurips26_jax.configs import lm_default


def get_config():
  c = lm_default.get_config()
  c.steps = 2000
  c.batch_size = 32
  c.eval_every = 250
  c.checkpoint_every = 500
  c.optim.update({"lr": 1e-3, "warmup_steps": 100})
  c.data = ml_collections.ConfigDict({
      "kind": "mqar", "path": "", "max_bytes": 0, "val_fraction": 0.05,
      "vocab": 8192, "options": {"num_pairs": 64, "power": 0.01}})
  c.model.update({"context": 512, "vocab_size": 8192, "num_layers": 2})
  c.sample.num_tokens = 0
  return c
