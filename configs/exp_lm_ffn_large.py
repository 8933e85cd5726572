"""FlashFFN against SwiGLU one size up: ~4.9M parameters, context 256 (Tiny Shakespeare).

  python -m experiments.lm_shakespeare --config=configs/exp_lm_ffn_large.py

d = 256, 6 layers, 4 attention heads; SwiGLU d_ff = 688 (8/3 d), FlashFFN with heads of width
128 (2 heads, the default) and of width 32 (8 heads: the width the 0.86M stdlib runs favoured),
E and d_e from the parameter-matching rule (E = 2, d_e = 256, whatever the head count); all
~4.85M parameters. Budget: 800 steps x batch 12 x context 256 = 2.46M tokens, 0.5 tokens per
parameter (the 0.86M runs had 1.8: the same ratio would be 3,750 steps, about 2 CPU-hours
per run here). Learning rates: the 0.86M sweep's three points halved (wider models want
smaller Adam steps), swept at seed 0, seeds 1 and 2 at each arm's best. About 25 minutes per run
pinned to one core of this 2-core machine.
"""

import ml_collections

from neurips26_jax.configs import exp_lm_ffn


def get_config(corpus: str = "shakespeare"):
  c = exp_lm_ffn.get_config(corpus)
  c.steps = 800
  c.eval_every = 200
  c.checkpoint_every = 200
  c.model.update({"context": 256, "d_model": 256, "num_layers": 6, "num_heads": 4})
  c.experiment.name = f"lm_ffn_large_{corpus}"
  c.experiment.order = ("swiglu", "flashffn_h128", "flashffn_h32")
  arms = c.experiment.arms
  arms["flashffn_h32"].ffn_options = {"num_heads": c.model.d_model // 32}
  c.experiment.arms = {k: arms[k] for k in c.experiment.order}
  c.experiment.lrs = (7.5e-4, 1.5e-3, 3e-3)
  c.experiment.eval_batch = 32
  return c
