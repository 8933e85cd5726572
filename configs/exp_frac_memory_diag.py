"""Long memory, diagnosis: why FRAC learned nothing beyond lag 2 on dense lag recall.

  python -m experiments.frac_memory --config=configs/exp_frac_memory_diag.py \
      --name=frac_memory_diag

Short runs (300 steps, L = 544, lags 1..256, scored on positions 257..543) of the same models
as configs/exp_frac_memory.py on the dense lag recall task (memory_tasks.lag_recall_lags: the
target at t is the input at t - lag, every position a fresh random symbol): FRAC, the
Mamba-2-style layer and attention (RoPE), same steps, same data. If the recurrent arms also
stop at the conv window (width 4) while attention goes further, the task (a delay line),
not FRAC's mode range / alpha / dt, is what limits them; and value_recall (one value held
over `lag` random distractors) on the same models and budget is the probe of memory length.
"""

from neurips26_jax.configs import exp_frac_memory


def get_config():
  c = exp_frac_memory.get_config()
  c.experiment.order = ("frac", "mamba2_params", "attention")
  c.experiment.tasks = {
      "lag_recall": {
          "length": 544, "vocab": 16, "lags": tuple(2 ** j for j in range(9)),
          "batch": 4, "steps": 300, "steps_by_arm": {}, "eval_sequences_per_lag": 8},
      "value_recall": {
          "kind": "value_recall", "length": 544, "vocab": 16,
          "lags": tuple(2 ** j for j in range(10)), "batch": 8, "steps": 300,
          "steps_by_arm": {}, "eval_batches": 8},
  }
  c.experiment.task_order = ("lag_recall", "value_recall")
  return c
