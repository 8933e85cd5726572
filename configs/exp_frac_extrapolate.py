"""Memory beyond the training length: FRAC against exponential-memory layers, trained at
L = 128 and evaluated at 4L, 8L and 16L.

  python -m experiments.frac_memory --config=configs/exp_frac_extrapolate.py \
      --name=frac_extrapolate --stages=train,extrapolate,plot

Task `kv_recall` (experiments.memory_tasks.kv_recall): 4 key-value pairs (16 keys, 16
values) at the start, then random value tokens everywhere (distractors from the answers'
alphabet), each key queried once at a gap drawn about uniformly in log g; the target is its
value (chance 1/16). Trained at L = 128 (gaps up to ~120), 1000 steps x batch 16; evaluated
per log2 gap bucket at L and, from the checkpoints, at 4L, 8L and 16L (gaps up to ~2000),
with the model's `context` kept at L. Sized by pilots (seed 0, lr 2e-3): at L FRAC and the
one-mode layer both reach ~0.75, the mamba_ssm-initialised layer ~0.36; at 400 steps all
are near 0.35 or chance.

Arms (2 blocks, d = 64, SwiGLU d_ff 128; mixers with 4 heads of width 16, N = 16, XLA path):
  frac             FRAC with the library defaults (alpha 0.19-0.86 across heads, rates for
                   warped times up to 4L, dt ~ 1, selective).
  one_mode_exp     the one-mode exponential layer (`mixer="mamba2"`): A_h log-spaced over
                   [1/L, 1], dt ~ 1: its slowest timescale 1/(A dt) at init is ~L tokens.
  mamba2_ssm_init  the same layer with mamba_ssm's Mamba2 initialisation (A_h ~ U[1, 16],
                   dt ~ logU[1e-3, 1e-1]): timescales 1/(A dt) up to ~1000 tokens at init.
  frac_fixed_dt    FRAC with dt a learned per-head constant (selective_dt=False).
Every arm at each of 3 learning rates with seed 0, then seeds 1 and 2 at its best (lowest
held-out loss at L).
"""

import ml_collections

from neurips26_jax.configs import exp_frac_memory


def get_config():
  c = exp_frac_memory.get_config()
  c.eval_batches = 8
  c.checkpoint_every = 200
  ssm = {"head_dim": 16, "state_dim": 16, "chunk": 64}
  c.model.num_heads = 4
  c.experiment.seeds = (0, 1, 2)
  c.experiment.lrs = (1e-3, 3e-3, 1e-2)
  c.experiment.order = ("frac", "one_mode_exp", "mamba2_ssm_init", "frac_fixed_dt")
  c.experiment.arms = {
      "frac": {"mixer": "frac", "mixer_options": ssm},
      "one_mode_exp": {"mixer": "mamba2", "mixer_options": ssm},
      "mamba2_ssm_init": {"mixer": "mamba2", "mixer_options": {**ssm, "init": "mamba_ssm"}},
      "frac_fixed_dt": {"mixer": "frac", "mixer_options": {**ssm, "selective_dt": False}},
  }
  c.experiment.tasks = {
      "kv_recall": {
          "kind": "kv_recall", "length": 128, "vocab": 34, "num_pairs": 4, "power": 0.01,
          "batch": 16, "steps": 1000, "steps_by_arm": {}, "eval_batches": 16,
          "eval_lengths": (1, 4, 8, 16), "extrapolate_batches": 32},
  }
  c.experiment.task_order = ("kv_recall",)
  return c
