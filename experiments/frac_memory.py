"""Experiment 3: long memory. FRAC against exponential-memory layers and attention: lag recall
(accuracy per lag, lags up to 2048), MQAR with power-law gaps (per gap), and memory beyond the
training length (train at L, evaluate at 4L-16L, per gap).

  python -m experiments.frac_memory --config=configs/exp_frac_memory.py \
      [--stages=train,kernels,dt,extrapolate,plot] [--tasks=lag_recall,mqar] \
      [--only=frac,attention] [--seeds=0]
  python -m experiments.frac_memory --config=configs/exp_frac_extrapolate.py \
      --name=frac_extrapolate --stages=train,extrapolate,plot

Every (task, arm, seed) trains with train.trainer.fit in runs/experiments/<name>/<task>/<arm>/
seed<k> and is then evaluated on held-out batches (stream VAL): lag recall with
config...eval_sequences_per_lag sequences per lag, MQAR over eval_batches batches bucketed
by log2 gap. With config.experiment.lrs (several learning rates) every arm is first trained
at each of them with the first seed, then with the other seeds at its best (lowest held-out
loss at the first seed); such runs are named <arm>@lr<lr>. A task with `eval_lengths` is
also evaluated at those lengths (multiples of its training length, same model: `context` stays
the training length) from the run's checkpoint (`extrapolate`: right after each run, and as a
stage for runs that lack it), with the memory clock of every recurrent arm at initialisation
and after training (`timescales`). Results go to results/<name>.json after each run (re-runs
skip finished runs; an unfinished one resumes from its checkpoint), the plot to
results/<name>.png.
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
from neurips26_jax import train
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.train import lm_task, trainer
from neurips26_jax.train.data import synthetic, text

NAME = "frac_memory"


def run_config(base, task: str, arm: str, seed: int, lr: float | None = None):
  """Trainer config of one (task, arm, seed): model sized for the task, steps per arm; at
  learning rate `lr` (None: the arm's `lr`, else the config's)."""
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
    if lr is not None:
      c.optim.lr = lr
    elif "lr" in a:
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
  elif kind == "kv_recall":
    make = functools.partial(memory_tasks.kv_recall, seed=config.seed, batch=t.batch,
                             length=t.length, vocab=t.vocab, num_pairs=t.num_pairs,
                             power=t.power)
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


def gap_edges(length: int) -> list[int]:
  """Bucket edges by log2 gap: [1, 4), [4, 8), [8, 16), ..., up to the first power of 2 >=
  length."""
  return [1] + [2 ** k for k in range(2, int(np.ceil(np.log2(length))) + 1)]


def gap_accuracy(task: str, t, model, config, length: int | None = None,
                 num_batches: int | None = None) -> dict:
  """MQAR / kv_recall: held-out accuracy per log2 gap bucket and overall, on num_batches
  (default t.eval_batches) batches of `length` (default t.length) tokens, generator seed
  10000 + seed."""
  kind = task_kind(task, t)
  length = length or t.length
  make = memory_tasks.kv_recall if kind == "kv_recall" else synthetic.mqar
  correct, gaps = [], []
  for i in range(num_batches or t.eval_batches):
    b = make(seed=10_000 + config.seed, stream=text.VAL, index=i, batch=t.batch, length=length,
             vocab=t.vocab, num_pairs=t.num_pairs, power=t.power)
    pred = predictions(model, b["inputs"], t.batch)
    m = b["mask"] > 0
    correct.append(pred[m] == b["targets"][m])
    gaps.append(memory_tasks.mqar_gaps(b)[m])
  correct, gaps = np.concatenate(correct), np.concatenate(gaps)
  return {"length": int(length), "n": int(correct.size),
          "by_gap": memory_tasks.bucket_accuracy(correct, gaps, gap_edges(length)),
          "accuracy": float(correct.mean()), "chance": 1.0 / ((t.vocab - synthetic.FIRST) // 2)}


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
  ev = gap_accuracy(task, t, model, config)
  return {k: ev[k] for k in ("by_gap", "accuracy", "chance")}


def trainer_task(base, task: str, arm: str, seed: int, lr: float | None = None):
  """(trainer config, trainer.Task) of one (task, arm, seed), its model freshly initialised."""
  t = base.experiment.tasks[task]
  config = run_config(base, task, arm, seed, lr)
  train_batch, eval_batch = batches(task, t, config)
  return config, trainer.Task(model=lm_task.make_model(config), loss_fn=lm_task.lm_loss,
                              train_batch=train_batch, eval_batch=eval_batch,
                              tokens_per_batch=t.batch * t.length)


def best_lr(base, results, task: str, arm: str, seed: int) -> float | None:
  """The swept rate with the lowest held-out loss (at the training length) of (task, arm) at
  `seed`; a run that diverged counts as worst. None until every rate has run."""
  losses = {}
  for lr in common.sweep_lrs(base):
    key = f"{task}/{common.run_key(common.run_label(base, arm, lr), seed)}"
    if not results.has(key):
      return None
    loss = results.runs[key].get("eval_loss")
    losses[lr] = np.inf if loss is None or not np.isfinite(loss) else loss
  return min(losses, key=losses.get)


def runs_of(base, arms, seeds, results, task: str):
  """(arm, lr, seed) to train, in order: `common.sweep_then_seeds`'s (every arm at every rate
  of `common.sweep_lrs` with seeds[0], then seeds[1:] at each arm's best, seed-major) for
  runs keyed by task; without a sweep, every seed and arm at the one rate of
  config.experiment.lrs, or with lr None (the arm's own `lr`, else the config's) if none. Lazy: the best rate is looked up when its runs are reached."""
  lrs = common.sweep_lrs(base)
  if len(lrs) == 1:
    lr = lrs[0] if base.experiment.get("lrs", None) else None
    for seed in seeds:
      for arm in arms:
        yield arm, lr, seed
    return
  for arm in arms:
    for lr in lrs:
      yield arm, lr, seeds[0]
  for seed in seeds[1:]:
    for arm in arms:
      yield arm, best_lr(base, results, task, arm, seeds[0]), seed


def flops_per_token(model, length: int) -> dict:
  """Forward FLOPs per token: `weights`, 2 per weight used once per token (every parameter
  of ndim >= 2 but the embedding table, a lookup); `xla`, the compiled forward's own count
  (XLA cost analysis on this backend, the scan and the conv included) at batch 1 and
  `length` tokens, divided by `length`."""
  weights = [p for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param))
             if p.ndim >= 2 and path[-1] != "embed"]
  graphdef, state = nnx.split(model)
  tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
  cost = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, tokens).compile()
  analysis = cost.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  xla = (analysis or {}).get("flops")
  return {"weights": int(2 * sum(p.size for p in weights)),
          "xla": None if xla is None else int(round(xla / length))}


def _workdir(runs_dir: pathlib.Path, name: str, task: str, label: str, seed: int):
  return runs_dir / name / task / label / f"seed{seed}"


def train_stage(base, tasks, arms, seeds, results, runs_dir, name: str = NAME) -> None:
  """Trains every (task, arm, seed) not in `results`, in runs_dir/<name>/<task>/<arm>/seed<k>
  (`name` = the results file's: a side study must not resume the main study's checkpoints);
  with a learning-rate sweep, see `runs_of`. A task with eval_lengths is evaluated there
  from the checkpoint right after its run (`extrapolate_run`)."""
  for task in tasks:
    t = base.experiment.tasks[task]
    for arm, lr, seed in runs_of(base, arms, seeds, results, task):
      key = f"{task}/{common.run_key(common.run_label(base, arm, lr), seed)}"
      if results.has(key):
        common.log(f"{key}: done already, skipped")
      else:
        _train_one(base, results, runs_dir, name, task, arm, lr, seed)
      if "eval_lengths" in t and "extrapolation" not in results.runs[key]:
        extrapolate_run(base, results, runs_dir, name, key)


def _train_one(base, results, runs_dir, name, task, arm, lr, seed) -> None:
  t = base.experiment.tasks[task]
  label = common.run_label(base, arm, lr)
  key = f"{task}/{common.run_key(label, seed)}"
  config, task_obj = trainer_task(base, task, arm, seed, lr)
  model = task_obj.model
  n = common.param_count(model)
  mixer = model.blocks[0].mixer
  state = (int(mixer.num_heads * mixer.num_modes * mixer.state_dim * mixer.head_dim)
           if config.model.mixer != "attention" else None)
  common.log(f"{key}: {n:,} parameters, recurrent state per layer {state}, "
             f"{config.steps} steps x batch {config.batch_size} x L {t.length}, lr "
             f"{config.optim.lr:g}, mixer_options {dict(config.model.mixer_options)}")
  workdir = _workdir(runs_dir, name, task, label, seed)
  load0, t0 = common.machine_load(), time.perf_counter()
  diverged = None
  try:
    fit = common.fit(config, workdir, task_obj, key)
  except trainer.NonFiniteLossError as e:
    if lr is None:
      raise
    diverged = str(e)
  wall = time.perf_counter() - t0
  row = {"task": task, "arm": arm, "lr": float(config.optim.lr), "seed": seed, "params": n,
         "state_per_layer": state, "steps": config.steps, "batch": config.batch_size,
         "length": t.length, "mixer": config.model.mixer,
         "mixer_options": dict(config.model.mixer_options), "workdir": str(workdir),
         "wall_s": wall, "load_start": load0, "load_end": common.machine_load(),
         **common.versions()}
  if "eval_lengths" in t:
    row["flops_per_token"] = flops_per_token(model, t.length)
  if diverged is not None:
    row.update({"diverged": diverged, "eval_loss": None, "final_train_loss": None,
                "accuracy": None, "extrapolation": None})
    results.put(key, row)
    common.log(f"{key}: diverged ({diverged[:80]}), recorded as the worst of the sweep")
    return
  ev = evaluate(task, t, fit.model, config)
  row.update({"final_train_loss": fit.final_loss, "eval_loss": fit.eval_loss,
              "steps_per_s": fit.steps_per_s, **ev})
  if config.model.mixer == "frac":
    row["alpha_final"] = [np.asarray(b.mixer.alpha()).round(3).tolist()
                          for b in fit.model.blocks]
  if config.model.mixer != "attention":
    row["timescale_final"] = [np.exp(np.asarray(b.mixer.log_timescale[...])).round(4)
                              .tolist() for b in fit.model.blocks]
  results.put(key, row)
  common.log(f"{key}: accuracy {ev['accuracy']:.3f}, eval loss {fit.eval_loss:.4f}, "
             f"wall {wall:.0f}s")


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


def memory_clock(model, inputs: np.ndarray, distractors: np.ndarray, gaps) -> list[dict]:
  """Per layer and head of a recurrent LM on `inputs` [B, L]: the mean dt over the distractor
  positions (`distractors` bool [B, L]), the slowest rate (FRAC: its tail mode, times
  exp(log_timescale); one-mode: A_h), the timescale 1 / (slowest rate x mean dt) in tokens,
  and the memory kernel K(u)/K(0) at u = gap x mean dt for each of `gaps` (the memory left
  after that many distractors if the clock runs at the distractors' rate)."""
  x = model.embed[...][jnp.asarray(inputs)]
  layers = []
  for block in model.blocks:
    mixer = block.mixer
    dt_raw = mixer._project(block.norm1(x))[-1]
    dt = np.asarray(jax.nn.softplus(dt_raw.astype(jnp.float32)
                                    + mixer.dt_bias[...].astype(jnp.float32)), np.float64)
    mean_dt = dt[distractors].mean(0)                                           # [H]
    rates, weights = (np.asarray(v, np.float64) for v in mixer.modes())
    slowest = rates.min(-1)
    u = np.asarray(gaps, np.float64)[None, :] * mean_dt[:, None]               # [H, gaps]
    k = (weights[:, None, :] * np.exp(-rates[:, None, :] * u[..., None])).sum(-1)
    layers.append({"dt_distractors": mean_dt.round(5).tolist(),
                   "slowest_rate": slowest.tolist(),
                   "timescale": (1.0 / (slowest * mean_dt)).round(1).tolist(),
                   "gaps": [int(g) for g in gaps],
                   "kernel_over_k0": (k / weights.sum(-1)[:, None]).round(5).tolist()})
    x = block(x)
  return layers


def extrapolate_run(base, results, runs_dir: pathlib.Path, name: str, key: str) -> None:
  """Evaluates the finished run `key` of a task with eval_lengths at each of them (its model
  restored from its workdir by train.load_model: the run's config, so the training `context`,
  and its last checkpoint's parameters), and probes its memory clock at
  initialisation and after training (`memory_clock` on the first held-out batch at the
  longest length, gaps L, 4L, 16L); written into its row."""
  row = dict(results.runs[key])
  if row.get("diverged"):
    return
  task = row["task"]
  t = base.experiment.tasks[task]
  config = run_config(base, task, row["arm"], row["seed"], row["lr"])
  t0 = time.perf_counter()
  model, _ = train.load_model(row["workdir"], step=config.steps)
  out = {}
  for n in t.eval_lengths:
    out[str(n)] = gap_accuracy(task, t, model, config, length=n * t.length,
                               num_batches=t.get("extrapolate_batches", t.eval_batches))
    common.log(f"{key}: at {n} L = {n * t.length}: accuracy {out[str(n)]['accuracy']:.3f}")
  row["extrapolation"] = out
  if config.model.mixer != "attention":
    longest = max(t.eval_lengths) * t.length
    b = memory_tasks.kv_recall(seed=10_000 + row["seed"], stream=text.VAL, index=0,
                               batch=t.batch, length=longest, vocab=t.vocab,
                               num_pairs=t.num_pairs, power=t.power)
    distractors = b["mask"] == 0
    distractors[:, :2 * t.num_pairs] = False
    gaps = [t.length * g for g in (1, 4, 16)]
    row["memory_clock"] = {
        "init": memory_clock(lm_task.make_model(config), b["inputs"], distractors, gaps),
        "trained": memory_clock(model, b["inputs"], distractors, gaps)}
  row["extrapolate_wall_s"] = time.perf_counter() - t0
  results.put(key, row)


def extrapolate_stage(base, tasks, results, runs_dir: pathlib.Path, name: str) -> None:
  """`extrapolate_run` for every finished run of a task with eval_lengths that lacks it."""
  for task in tasks:
    if "eval_lengths" not in base.experiment.tasks[task]:
      continue
    for key, row in list(results.runs.items()):
      if row.get("task") == task and "extrapolation" not in row:
        extrapolate_run(base, results, runs_dir, name, key)


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


def rows_at_best_lr(runs: dict, task: str) -> dict:
  """{arm: [rows of its best learning rate, by seed]} from a results file's runs of `task`.

  The best rate is the one with the lowest held-out loss at the training length with the
  first seed (diverged: worst); without a sweep (rows without "lr", or one rate), all rows."""
  rows = [r for r in runs.values() if r.get("task") == task]
  out = {}
  for arm in dict.fromkeys(r["arm"] for r in rows):
    mine = [r for r in rows if r["arm"] == arm]
    first = min(r["seed"] for r in mine)
    at_first = {r.get("lr"): r for r in mine if r["seed"] == first}
    loss = lambda r: np.inf if r.get("eval_loss") is None else r["eval_loss"]
    best = min(at_first.values(), key=loss).get("lr")
    out[arm] = sorted((r for r in mine if r.get("lr") == best), key=lambda r: r["seed"])
  return out


def plot_extrapolation(results, base, task: str, path) -> None:
  """Accuracy per log2 gap bucket at each evaluation length, one panel per length: per arm the
  mean over seeds at its best learning rate, the band spanning the seeds; the training length
  L marked (the longest gap seen in training)."""
  t = base.experiment.tasks[task]
  at_best = rows_at_best_lr(results.runs, task)
  order = [a for a in base.experiment.order if a in at_best]
  lengths = list(t.eval_lengths)
  plt = common.pyplot()
  fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4.4), squeeze=False,
                           sharey=True)
  for ax, n in zip(axes[0], lengths):
    for i, arm in enumerate(order):
      rows = [r for r in at_best[arm] if r.get("extrapolation")]
      if not rows:
        continue
      buckets = [r["extrapolation"][str(n)]["by_gap"] for r in rows]
      keep = [j for j, b in enumerate(buckets[0]) if b["n"] > 0]
      x = [np.sqrt(buckets[0][j]["lo"] * buckets[0][j]["hi"]) for j in keep]
      acc = np.array([[bs[j]["accuracy"] for j in keep] for bs in buckets])
      ax.plot(x, acc.mean(0), "o-", color=f"C{i}", markersize=4,
              label=f"{arm} (lr {rows[0]['lr']:g}, {len(rows)} seeds)")
      if len(rows) > 1:
        ax.fill_between(x, acc.min(0), acc.max(0), color=f"C{i}", alpha=0.15)
    ax.axhline(1.0 / ((t.vocab - synthetic.FIRST) // 2), color="gray", ls=":", label="chance")
    ax.axvline(t.length, color="black", ls="--", lw=0.8, label=f"training length L={t.length}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("gap, query - its value (tokens)")
    ax.set_title(f"{task}: evaluated at {n} L = {n * t.length}")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out accuracy")
  axes[0][-1].legend(fontsize=7, loc="lower left")
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
  if len(common.sweep_lrs(base)) > 1:
    results.data["meta"]["lrs"] = list(common.sweep_lrs(base))
  stages = F.stages.split(",")
  if "train" in stages:
    train_stage(base, tasks, arms, seeds, results, pathlib.Path(F.runs_dir), F.name)
  if "kernels" in stages:
    kernels_stage(base, tasks, arms, results)
  if "dt" in stages:
    dt_stage(base, arms, seeds, results, pathlib.Path(F.runs_dir), F.name)
  if "extrapolate" in stages:
    extrapolate_stage(base, tasks, results, pathlib.Path(F.runs_dir), F.name)
  if "plot" in stages:
    path = pathlib.Path(F.results_dir) / f"{F.name}.png"
    extrapolated = [task for task in base.experiment.task_order
                    if "eval_lengths" in base.experiment.tasks[task]]
    if extrapolated:
      plot_extrapolation(results, base, extrapolated[0], path)
    else:
      plot(results, base, list(base.experiment.task_order), path)
  results.save()


if __name__ == "__main__":
  common.define_flags("configs/exp_frac_memory.py", "train,plot")
  flags.DEFINE_string("tasks", "", "Comma-separated tasks (default: all).")
  flags.DEFINE_string("name", NAME, "Results file name (side studies).")
  app.run(main)
