"""Experiment 3: long memory. FRAC vs Mamba-2-style (equal parameters, equal state) vs attention
on lag recall (accuracy per lag, lags up to 2048) and MQAR with power-law gaps (per gap).

  python -m experiments.frac_memory --config=configs/exp_frac_memory.py \
      [--stages=train,kernels,dt,plot] [--tasks=lag_recall,mqar] [--only=frac,attention]
      [--seeds=0]

Every (task, arm, seed) trains with train.trainer.fit in runs/experiments/frac_memory/<task>/
<arm>/seed<k> and is then evaluated on held-out batches (stream VAL): lag recall with
config...eval_sequences_per_lag sequences per lag, MQAR over eval_batches batches bucketed
by log2 gap. Results go to results/frac_memory.json after each run (re-runs skip finished
runs; an unfinished one resumes from its checkpoint), the plot to results/frac_memory.png.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from experiments import common, memory_tasks
from jaxops import frac as frac_ops
from train import lm_task, trainer
from train.data import synthetic, text

NAME = "frac_memory"


def run_config(base, task: str, arm: str, seed: int):
  """Trainer config of one (task, arm, seed): model sized for the task, steps per arm."""
  t = base.experiment.tasks[task]
  a = base.experiment.arms[arm]
  c = copy.deepcopy(base)
  with c.unlocked():
    c.seed = seed
    c.batch_size = t.batch
    c.steps = int(t.get("steps_by_arm", {}).get(arm, t.steps))
    c.eval_every = max(1, c.steps // 4)
    c.model.context = t.length
    c.model.vocab_size = t.vocab
    c.model.mixer = a.mixer
    options = dict(a.mixer_options)
    options.update(dict(a.get("mixer_overrides", {})))
    if a.get("state_times_modes", False):
      options["state_dim"] = options["state_dim"] * frac_ops.default_num_modes(t.length)
    c.model.mixer_options = options
    for key in ("d_model", "num_layers", "num_heads"):
      if key in a:
        c.model[key] = a[key]
    if "lr" in a:
      c.optim.lr = a.lr
    del c["experiment"]
  return c


def task_kind(task: str, t) -> str:
  """The generator of a task: its config's `kind`, else its name (lag_recall, value_recall,
  mqar)."""
  return t.get("kind", task)


def batches(task: str, t, config):
  """(train_batch(step), eval_batch(i)) for the trainer."""
  kind = task_kind(task, t)
  if kind == "lag_recall":
    make = functools.partial(memory_tasks.lag_recall_lags, seed=config.seed, batch=t.batch,
                             length=t.length, vocab=t.vocab, lags=tuple(t.lags))
  elif kind == "value_recall":
    make = functools.partial(memory_tasks.value_recall, seed=config.seed, batch=t.batch,
                             length=t.length, vocab=t.vocab, lags=tuple(t.lags))
  else:
    make = functools.partial(synthetic.mqar, seed=config.seed, batch=t.batch, length=t.length,
                             vocab=t.vocab, num_pairs=t.num_pairs, power=t.power)
  return (lambda step: make(stream=text.TRAIN, index=step),
          lambda i: make(stream=text.VAL, index=i))


@functools.partial(jax.jit, static_argnums=0)
def _predict(graphdef, state, inputs):
  return jnp.argmax(nnx.merge(graphdef, state)(inputs), -1)


def predictions(model, inputs: np.ndarray, batch: int) -> np.ndarray:
  graphdef, state = nnx.split(model)
  return np.concatenate([np.asarray(_predict(graphdef, state, inputs[i:i + batch]))
                         for i in range(0, len(inputs), batch)])


def evaluate(task: str, t, model, config) -> dict:
  """Held-out accuracy per lag (lag recall) or per log2 gap bucket (MQAR), plus overall."""
  kind = task_kind(task, t)
  if kind == "value_recall":
    correct = []
    for i in range(t.eval_batches):
      b = memory_tasks.value_recall(seed=10_000 + config.seed, stream=text.VAL, index=i,
                                    batch=t.batch, length=t.length, vocab=t.vocab,
                                    lags=tuple(t.lags))
      pred = predictions(model, b["inputs"], t.batch)
      correct.append(pred[:, 1 + np.asarray(t.lags)] == b["targets"][:, 1 + np.asarray(t.lags)])
    correct = np.concatenate(correct)                       # [sequences, lags]
    rows = [{"lag": int(lag), "n": int(correct.shape[0]),
             "accuracy": float(correct[:, j].mean())} for j, lag in enumerate(t.lags)]
    return {"by_lag": rows, "accuracy": float(correct.mean()),
            "chance": 1.0 / (t.vocab - synthetic.FIRST)}
  if kind == "lag_recall":
    rows = []
    for j, lag in enumerate(t.lags):
      b = memory_tasks.lag_recall_lags(seed=10_000 + config.seed, stream=text.VAL, index=j,
                                       batch=t.eval_sequences_per_lag, length=t.length,
                                       vocab=t.vocab, lags=tuple(t.lags), lag_index=j)
      pred = predictions(model, b["inputs"], t.batch)
      m = b["mask"] > 0
      rows.append({"lag": int(lag), "n": int(m.sum()),
                   "accuracy": float((pred[m] == b["targets"][m]).mean())})
    return {"by_lag": rows, "accuracy": float(np.mean([r["accuracy"] for r in rows])),
            "chance": 1.0 / (t.vocab - synthetic.FIRST)}
  correct, gaps = [], []
  for i in range(t.eval_batches):
    b = synthetic.mqar(seed=10_000 + config.seed, stream=text.VAL, index=i, batch=t.batch,
                       length=t.length, vocab=t.vocab, num_pairs=t.num_pairs, power=t.power)
    pred = predictions(model, b["inputs"], t.batch)
    m = b["mask"] > 0
    correct.append(pred[m] == b["targets"][m])
    gaps.append(memory_tasks.mqar_gaps(b)[m])
  correct, gaps = np.concatenate(correct), np.concatenate(gaps)
  edges = [1] + [2 ** k for k in range(2, int(np.ceil(np.log2(t.length))) + 1)]
  return {"by_gap": memory_tasks.bucket_accuracy(correct, gaps, edges),
          "accuracy": float(correct.mean()), "chance": 1.0 / ((t.vocab - synthetic.FIRST) // 2)}


def trainer_task(base, task: str, arm: str, seed: int):
  """(trainer config, trainer.Task) of one (task, arm, seed), its model freshly initialised."""
  t = base.experiment.tasks[task]
  config = run_config(base, task, arm, seed)
  train_batch, eval_batch = batches(task, t, config)
  return config, trainer.Task(model=lm_task.make_model(config), loss_fn=lm_task.lm_loss,
                              train_batch=train_batch, eval_batch=eval_batch,
                              tokens_per_batch=t.batch * t.length)


def train_stage(base, tasks, arms, seeds, results, runs_dir, name: str = NAME) -> None:
  """Trains every (task, arm, seed) not in `results`, in runs_dir/<name>/<task>/<arm>/seed<k>
  (`name` = the results file's: a side study must not resume the main study's checkpoints)."""
  for task in tasks:
    t = base.experiment.tasks[task]
    for seed in seeds:
      for arm in arms:
        key = f"{task}/{common.run_key(arm, seed)}"
        if results.has(key):
          common.log(f"{key}: done already, skipped")
          continue
        config, task_obj = trainer_task(base, task, arm, seed)
        model = task_obj.model
        n = common.param_count(model)
        mixer = model.blocks[0].mixer
        state = (int(mixer.num_heads * mixer.num_modes * mixer.state_dim * mixer.head_dim)
                 if config.model.mixer != "attention" else None)
        common.log(f"{key}: {n:,} parameters, recurrent state per layer {state}, "
                   f"{config.steps} steps x batch {config.batch_size} x L {t.length}, "
                   f"mixer_options {dict(config.model.mixer_options)}")
        workdir = runs_dir / name / task / arm / f"seed{seed}"
        load0, t0 = common.machine_load(), time.perf_counter()
        fit = trainer.fit(config, workdir, task_obj)
        wall = time.perf_counter() - t0
        ev = evaluate(task, t, fit.model, config)
        row = {"task": task, "arm": arm, "seed": seed, "params": n, "state_per_layer": state,
               "steps": config.steps, "batch": config.batch_size, "length": t.length,
               "mixer_options": dict(config.model.mixer_options),
               "final_train_loss": fit.final_loss, "eval_loss": fit.eval_loss,
               "steps_per_s": fit.steps_per_s, "wall_s": wall, "load_start": load0,
               "load_end": common.machine_load(), **ev}
        if config.model.mixer == "frac":
          row["alpha_final"] = [np.asarray(b.mixer.alpha()).round(3).tolist()
                                for b in fit.model.blocks]
        if config.model.mixer != "attention":
          row["timescale_final"] = [np.exp(np.asarray(b.mixer.log_timescale[...])).round(4)
                                    .tolist() for b in fit.model.blocks]
        results.put(key, row)
        common.log(f"{key}: accuracy {ev['accuracy']:.3f}, wall {wall:.0f}s")


def kernels_stage(base, tasks, arms, results) -> None:
  """The memory kernel each recurrent arm starts from, per head: K(u) / K(0) at the task's
  lags, u in warped time (u = lag * dt, dt = softplus(dt_bias) at init), with alpha, dt and
  the mode rates; written to results["kernels_at_init"] (no training)."""
  out = {}
  for task in tasks:
    t = base.experiment.tasks[task]
    for arm in arms:
      config = run_config(base, task, arm, 0)
      if config.model.mixer == "attention":
        continue
      m = lm_task.make_model(config).blocks[0].mixer
      rates, weights = (np.asarray(v, np.float64) for v in m.modes())
      dt = np.asarray(jax.nn.softplus(m.dt_bias[...]), np.float64)
      lags = np.asarray(t.get("lags", 2 ** np.arange(int(np.log2(t.length)) + 1)),
                        np.float64)                     # MQAR: gaps 1, 2, 4, ... up to L
      u = lags[None, :] * dt[:, None]                                        # [H, lags]
      k = (weights[:, None, :] * np.exp(-rates[:, None, :] * u[..., None])).sum(-1)
      out[f"{task}/{arm}"] = {
          "lags": lags.astype(int).tolist(), "dt_init": dt.round(4).tolist(),
          "alpha_init": np.asarray(m.alpha()).round(4).tolist(), "num_modes": int(m.num_modes),
          "rate_min": float(rates.min()), "rate_max": float(rates.max()),
          "kernel_over_k0": (k / weights.sum(-1)[:, None]).round(5).tolist()}
      common.log(f"kernel {task}/{arm}: K(lag)/K(0) per head at lags {lags[-3:]}: "
                 f"{(k / weights.sum(-1)[:, None])[:, -3:].round(4).tolist()}")
  results.set("kernels_at_init", out)


def _trained_model(base, task: str, arm: str, seed: int, runs_dir: pathlib.Path, name: str):
  """The model of a finished run, restored from its workdir (fit resumes at the last step and
  trains nothing)."""
  config, task_obj = trainer_task(base, task, arm, seed)
  return trainer.fit(config, runs_dir / name / task / arm / f"seed{seed}", task_obj).model


def dt_stage(base, arms, seeds, results, runs_dir: pathlib.Path, name: str) -> None:
  """How far the trained recurrent arms let their memory clock run on value recall.

  Per layer and head, on held-out sequences: dt at the value (position 1), the mean dt over
  the distractors, and the warped time between the value and the query at the longest lag,
  Delta T = sum of dt over the positions after the value up to that query, with the trained
  memory kernel there, K(Delta T) / K(0) (K(u) = sum_m w_m exp(-r_m u)). A selective layer can
  hold one token over any lag by keeping dt near 0 on the distractors, whatever the shape of
  K; at initialisation dt ~ 1, so Delta T ~ lag. Written to results["dt_probe"]."""
  task = "value_recall"
  t = base.experiment.tasks[task]
  lag = int(max(t.lags))
  b = memory_tasks.value_recall(seed=10_000, stream=text.VAL, index=0, batch=t.batch,
                                length=t.length, vocab=t.vocab, lags=tuple(t.lags))
  out = {}
  for arm in arms:
    for seed in seeds:
      key = f"{task}/{common.run_key(arm, seed)}"
      if base.experiment.arms[arm].mixer == "attention" or not results.has(key):
        continue
      model = _trained_model(base, task, arm, seed, runs_dir, name)
      x = model.embed[...][jnp.asarray(b["inputs"])]
      layers = []
      for block in model.blocks:
        mixer = block.mixer
        dt_raw = mixer._project(block.norm1(x))[-1]
        dt = np.asarray(jax.nn.softplus(dt_raw + mixer.dt_bias[...]), np.float64)  # [B, L, H]
        rates, weights = (np.asarray(v, np.float64) for v in mixer.modes())
        distractors = np.ones(t.length, bool)
        distractors[[0, 1, *(1 + np.asarray(t.lags))]] = False
        span = dt[:, 2:2 + lag].sum(1)                                     # [B, H]
        k = (weights[None] * np.exp(-rates[None] * span[..., None])).sum(-1) / weights.sum(-1)
        layers.append({"dt_value": dt[:, 1].mean(0).round(4).tolist(),
                       "dt_distractors": dt[:, distractors].mean((0, 1)).round(5).tolist(),
                       "dt_queries": dt[:, 1 + np.asarray(t.lags)].mean((0, 1)).round(4).tolist(),
                       "delta_t_longest_lag": span.mean(0).round(2).tolist(),
                       "kernel_over_k0_longest_lag": k.mean(0).round(5).tolist()})
        x = block(x)
      out[key] = {"longest_lag": lag, "layers": layers}
      common.log(f"dt {key}: " + "; ".join(
          f"layer {i}: dt distractors {l['dt_distractors']}, Delta T({lag}) "
          f"{l['delta_t_longest_lag']}, K/K0 {l['kernel_over_k0_longest_lag']}"
          for i, l in enumerate(layers)))
  results.set("dt_probe", out)


def plot(results, base, tasks, path) -> None:
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 4.6), squeeze=False)
  order = list(base.experiment.order) + sorted(
      {r["arm"] for r in results.runs.values()} - set(base.experiment.order))
  for ax, task in zip(axes[0], tasks):
    chance = None
    for i, arm in enumerate(order):
      rows = [r for r in results.runs.values() if r["task"] == task and r["arm"] == arm]
      if not rows:
        continue
      chance = rows[0]["chance"]
      field, x_of = (("by_lag", lambda b: b["lag"]) if "by_lag" in rows[0]
                     else ("by_gap", lambda b: np.sqrt(b["lo"] * b["hi"])))
      buckets = [[b for b in r[field] if b["accuracy"] is not None] for r in rows]
      n = min(len(b) for b in buckets)
      x = [x_of(b) for b in buckets[0][:n]]
      acc = np.array([[b["accuracy"] for b in bs[:n]] for bs in buckets])
      label = f"{arm} ({rows[0]['steps']} steps)"
      ax.plot(x, acc.mean(0), "o-", color=f"C{i}", label=label, markersize=4)
      if len(rows) > 1:
        ax.fill_between(x, acc.min(0), acc.max(0), color=f"C{i}", alpha=0.2)
    if chance is not None:
      ax.axhline(chance, color="gray", ls=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    recall = task_kind(task, base.experiment.tasks[task]) != "mqar"
    ax.set_xlabel("lag (tokens)" if recall else "gap, query - its pair (tokens)")
    ax.set_ylabel("held-out accuracy")
    t = base.experiment.tasks[task]
    ax.set_title(f"{task}, L={t.length}" + ("" if recall else f", {t.num_pairs} pairs"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  common.savefig(fig, path)


def main(argv):
  del argv
  F = flags.FLAGS
  logging.set_verbosity(logging.WARNING)
  base = F.config
  tasks = common.selected(base.experiment.task_order, F.tasks)
  arms = common.selected(base.experiment.order, F.only)
  seeds = common.seeds_from(F.seeds, base)
  results = common.Results(F.name, directory=F.results_dir)
  common.record_command(results)
  stages = F.stages.split(",")
  if "train" in stages:
    train_stage(base, tasks, arms, seeds, results, pathlib.Path(F.runs_dir), F.name)
  if "kernels" in stages:
    kernels_stage(base, tasks, arms, results)
  if "dt" in stages:
    dt_stage(base, arms, seeds, results, pathlib.Path(F.runs_dir), F.name)
  if "plot" in stages:
    plot(results, base, list(base.experiment.task_order),
         pathlib.Path(F.results_dir) / f"{F.name}.png")
  results.save()


if __name__ == "__main__":
  common.define_flags("configs/exp_frac_memory.py", "train,plot")
  flags.DEFINE_string("tasks", "", "Comma-separated tasks (default: all).")
  flags.DEFINE_string("name", NAME, "Results file name (side studies).")
  app.run(main)
