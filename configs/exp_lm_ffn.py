"""FlashFFN against SwiGLU in the attention LM, each at its own best learning rate.

  python -m experiments.lm_shakespeare --config=configs/exp_lm_ffn.py            # Tiny Shakespeare
  python -m experiments.lm_shakespeare --config=configs/exp_lm_ffn.py:stdlib     # make demo's corpus

The budget of exp_lm_shakespeare (2000 steps x batch 12 x context 64, d = 128, 4 layers, 4
attention heads, ~0.86M parameters). Arms: SwiGLU at its default width (8/3 d = 344) and
FlashFFN with heads of width 32, 64 and 128, each with the library's defaults (scaled init;
E, d_e from `models.flash_ffn.flashffn_shape`: E = 2, d_e = 128), so every arm has
attention + SwiGLU's parameter count within 0.3%. Their forward FLOPs per token are then
matched too (2 per weight for both FFNs; recorded in every row as flops_per_token), so the
matched-parameter and matched-FLOP comparisons are the same runs. Every arm is swept over
three learning rates with seed 0, then run with seeds 1 and 2 at its best.
The stdlib corpus is cut to its first 1.2M bytes (Tiny Shakespeare has 1.1M), so the
whole-split evaluation costs the same.
"""

import ml_collections

from neurips26_jax.configs import exp_lm_shakespeare

CORPORA = {"shakespeare": ("data/tinyshakespeare.txt", 0), "stdlib": ("", 1_200_000)}


def get_config(corpus: str = "shakespeare"):
  c = exp_lm_shakespeare.get_config()
  c.data.path, c.data.max_bytes = CORPORA[corpus]
  arm = lambda ffn, ffn_options: ml_collections.ConfigDict(
      {"mixer": "attention", "ffn": ffn, "mixer_options": {}, "ffn_options": ffn_options})
  c.experiment.name = f"lm_ffn_{corpus}"
  c.experiment.reference_arm = "swiglu"
  c.experiment.order = ("swiglu", "flashffn_h128", "flashffn_h64", "flashffn_h32")
  c.experiment.arms = {
      "swiglu": arm("swiglu", {}),
      "flashffn_h128": arm("flashffn", {}),
      "flashffn_h64": arm("flashffn", {"num_heads": 2}),
      "flashffn_h32": arm("flashffn", {"num_heads": 4}),
  }
  c.experiment.lrs = (1.5e-3, 3e-3, 6e-3)
  return c
