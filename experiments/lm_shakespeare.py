"""Experiment 4: byte-level Tiny Shakespeare, attention / FRAC / Mamba-2 x SwiGLU / FlashFFN.

  python -m experiments.lm_shakespeare --config=configs/exp_lm_shakespeare.py \
      [--stages=train,throughput,profile,plot] [--only=arm1,arm2] [--seeds=0,1,2]

Stages:
  train       every arm x seed with train.trainer.fit (workdir runs/experiments/lm_shakespeare/
              <arm>/seed<k>), then the loss on the WHOLE validation split (every character of
              the last config.data.val_fraction of the file scored once); each finished run is
              written to results/lm_shakespeare.json at once and skipped by a re-run.
  throughput  a side-by-side timing of one jitted train step per arm (config.experiment.
              throughput_steps steps per round after warm-up, arms interleaved, best round);
              waits up to --idle_wait_s for a 1-minute load average below --idle_load.
  profile     where a step's time goes: forward+backward of each block's mixer and FFN alone,
              the FRAC scan alone, and XLA's FLOP counts, at the training shape.
  plot        results/lm_shakespeare.png from the json.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx

from experiments import common
from neurips26_jax.train import lm_task
from neurips26_jax.train.data import text
from neurips26_jax.train.metrics import read_metrics

NAME = "lm_shakespeare"


# ----------------------------------------------------------------------------- evaluation

def whole_split_windows(data: np.ndarray, length: int):
  """Every character of `data` after the first, scored exactly once.

  Cuts data[:-1] into consecutive windows of `length` inputs (the last one padded), so
  window w predicts data[w L + 1 : (w + 1) L + 1] from the characters before it in the
  window. Returns int32 inputs, targets [W, length] and float32 mask [W, length]
  (0 on the padding); mask.sum() == len(data) - 1.
  """
  n = len(data) - 1
  if n < 1:
    raise ValueError(f"whole_split_windows: need at least 2 characters, got {len(data)}")
  w = -(-n // length)
  padded = np.zeros(w * length + 1, np.int32)
  padded[:len(data)] = data
  mask = (np.arange(w * length) < n).astype(np.float32).reshape(w, length)
  return padded[:-1].reshape(w, length), padded[1:].reshape(w, length), mask


@functools.partial(jax.jit, static_argnums=0)
def _ce_sum(graphdef, state, inputs, targets, mask):
  logits = nnx.merge(graphdef, state)(inputs)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(ce * mask)


def whole_split_loss(model, data: np.ndarray, length: int, *, batch: int = 128) -> float:
  """Mean cross entropy (nats per character) of `model` over every character of `data`
  (see `whole_split_windows`), in batches of `batch` windows (the last padded)."""
  inputs, targets, mask = whole_split_windows(data, length)
  pad = -len(inputs) % batch
  if pad:
    inputs, targets, mask = (np.concatenate([a, np.zeros((pad, length), a.dtype)])
                             for a in (inputs, targets, mask))
  graphdef, state = nnx.split(model)
  total = 0.0
  for i in range(0, len(inputs), batch):
    total += float(_ce_sum(graphdef, state, inputs[i:i + batch], targets[i:i + batch],
                           mask[i:i + batch]))
  return total / float(mask.sum())


# ----------------------------------------------------------------------------- arms

def arm_config(base, arm: str, seed: int, lr: float | None = None):
  """The trainer config of one arm and seed (at learning rate `lr`, None: the config's)."""
  c = copy.deepcopy(base)
  with c.unlocked():
    c.seed = seed
    for key, value in base.experiment.arms[arm].items():   # replaced whole, not merged
      c.model[key] = value
    if lr is not None:
      c.optim.lr = lr
    del c["experiment"]
  return c


def model_params(config) -> int:
  kwargs = config.model.to_dict()
  from neurips26_jax.models.lm import LanguageModel  # noqa: PLC0415
  return common.param_count(nnx.eval_shape(lambda: LanguageModel(**kwargs, rngs=nnx.Rngs(0))))


def check_matched(base, arms) -> dict:
  """{arm: parameter count}; ValueError if an arm is off the reference by more than the
  tolerance."""
  counts = {a: model_params(arm_config(base, a, 0)) for a in base.experiment.arms}
  ref = counts[base.experiment.reference_arm]
  for a in arms:
    off = counts[a] / ref - 1
    if abs(off) > base.experiment.param_tolerance:
      raise ValueError(f"arm {a}: {counts[a]:,} parameters, {off:+.1%} off the reference "
                       f"{ref:,} (tolerance {base.experiment.param_tolerance:.0%})")
  return counts


def curve(workdir) -> dict:
  rows = read_metrics(workdir / "metrics.jsonl")
  return {"train": [(r["step"], r["loss"]) for r in rows if "loss" in r and r["step"] % 50 == 0
                    or "loss" in r and r["step"] == rows[-1]["step"]],
          "eval": [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r],
          "tokens_per_s": [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][-1:]}


def train_stage(base, arms, seeds, results: common.Results, runs_dir) -> None:
  """Every arm at every swept learning rate with the first seed, then the other seeds at each
  arm's best learning rate (its lowest whole-split loss at the first seed)."""
  counts = check_matched(base, arms)
  results.data["meta"].update({
      "param_counts": counts, "budget": {"steps": base.steps, "batch": base.batch_size,
                                         "context": base.model.context},
      "data": base.data.path or "stdlib", "max_bytes": base.data.max_bytes,
      "val_fraction": base.data.val_fraction, "lrs": list(common.sweep_lrs(base))})
  _, val_bytes = text.split(text.load_corpus(base.data.path, max_bytes=base.data.max_bytes),
                            base.data.val_fraction)
  run = functools.partial(_train_one, base, results, runs_dir, counts, val_bytes)
  common.sweep_then_seeds(base, arms, seeds, results, run, "val_loss_whole")


def _train_one(base, results, runs_dir, counts, val_bytes, arm: str, lr: float, seed: int):
  label = common.run_label(base, arm, lr)
  key = common.run_key(label, seed)
  if results.has(key):
    common.log(f"{key}: done already, skipped")
    return
  config = arm_config(base, arm, seed, lr)
  workdir = runs_dir / common.experiment_name(base, NAME) / label / f"seed{seed}"
  task = lm_task.build_task(config)
  n = common.param_count(task.model)
  common.log(f"{key}: {n:,} parameters ({n / counts[base.experiment.reference_arm] - 1:+.2%}"
             f" vs {base.experiment.reference_arm}); workdir {workdir}")
  load0, t0 = common.machine_load(), time.perf_counter()
  fit = common.fit(config, workdir, task, key)
  wall = time.perf_counter() - t0
  t1 = time.perf_counter()
  val = whole_split_loss(fit.model, val_bytes, config.model.context,
                         batch=base.experiment.eval_batch)
  row = {"arm": arm, "lr": config.optim.lr, "seed": seed, "params": n,
         "flops_per_token": model_flops_per_token(fit.model), "val_loss_whole": val,
         "val_chars": int(len(val_bytes) - 1), "eval_loss_sampled": fit.eval_loss,
         "final_train_loss": fit.final_loss, "steps_per_s": fit.steps_per_s,
         "tokens_per_s_in_run": (None if fit.steps_per_s is None else
                                 fit.steps_per_s * config.batch_size * config.model.context),
         "wall_s": wall, "eval_wall_s": time.perf_counter() - t1,
         "load_start": load0, "load_end": common.machine_load(), "curve": curve(workdir),
         **common.versions()}
  results.put(key, row)
  common.log(f"{key}: whole-split val {val:.4f} nats/char, wall {wall:.0f}s")


def model_flops_per_token(model) -> int:
  """Forward matmul FLOPs per token of the model's weights: 2 per weight used once per token
  (every parameter of ndim >= 2 but the embedding table, which is a lookup). Attention's
  score and value products (2 * 2 L d per token at context L) are not included: they are the
  same in every arm of one mixer."""
  weights = [p for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param))
             if p.ndim >= 2 and path[-1] != "embed"]
  return int(2 * sum(p.size for p in weights))


# ----------------------------------------------------------------------------- timing

def make_train_step(config):
  """(jitted step, params, opt_state, batch) for the config's model (`common.make_train_step`
  on lm_loss, the first training batch)."""
  task = lm_task.build_task(config)
  batch = {k: jnp.asarray(v) for k, v in task.train_batch(0).items()}
  return (*common.make_train_step(task.model, lm_task.lm_loss, config.optim, config.steps),
          batch)


def throughput_stage(base, arms, results: common.Results) -> None:
  e = base.experiment
  steps = {a: make_train_step(arm_config(base, a, 0)) for a in arms}
  results.set("throughput", common.throughput(steps, base.batch_size * base.model.context,
                                              e.throughput_rounds, e.throughput_steps))


def _fwd_bwd(module, *inputs):
  """jitted fn(params, *inputs) -> grads of sum(module(*inputs) * cotangent) wrt params and
  the first input, plus its FLOP count from XLA."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)

  def loss(p, x, *more):
    y = nnx.merge(graphdef, p, rest)(x, *more)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

  fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
  compiled = fn.lower(params, *inputs).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return functools.partial(fn, params), float((cost or {}).get("flops", float("nan")))


def profile_stage(base, arms, results: common.Results, repeats: int = 30) -> None:
  """Per arm: train step, and per layer the mixer and FFN forward+backward alone (ms, FLOPs);
  for FlashFFN arms also the FFN through the einsum reference (no chunking/recomputation);
  for FRAC / Mamba-2 arms the scan alone (jaxops.frac.frac_scan, the mixer's XLA path)."""
  from neurips26_jax.jaxops import frac as frac_ops  # noqa: PLC0415
  b, l, d = base.batch_size, base.model.context, base.model.d_model
  x = jax.random.normal(jax.random.key(0), (b, l, d))
  before = common.machine_load()
  out = {}
  for a in arms:
    config = arm_config(base, a, 0)
    step, params, opt_state, batch = make_train_step(config)
    model = lm_task.make_model(config)
    block = model.blocks[0]
    row = {"train_step_ms": 1e3 * common.timed(step, params, opt_state, batch, repeats=repeats)}
    for part in ("mixer", "ffn"):
      fn, flops = _fwd_bwd(getattr(block, part), x)
      row[f"{part}_ms_per_layer"] = 1e3 * common.timed(fn, x, repeats=repeats)
      row[f"{part}_gflops_per_layer"] = flops / 1e9
    if config.model.ffn == "flashffn":          # the same FFN through the einsum reference
      ref_config = copy.deepcopy(config)        # (no token chunks, no recomputation)
      ref_config.model.impl = "reference"
      ref_ffn = lm_task.make_model(ref_config).blocks[0].ffn
      fn, flops = _fwd_bwd(ref_ffn, x)
      row["ffn_reference_ms_per_layer"] = 1e3 * common.timed(fn, x, repeats=repeats)
      row["ffn_reference_gflops_per_layer"] = flops / 1e9
    if config.model.mixer in ("frac", "mamba2"):
      m = block.mixer
      h, p, n = m.num_heads, m.head_dim, m.state_dim
      keys = jax.random.split(jax.random.key(1), 4)
      xs = jax.random.normal(keys[0], (b, l, h, p))
      dt = jax.nn.softplus(jax.random.normal(keys[1], (b, l, h)))
      bb, cc = (jax.random.normal(k, (b, l, h, n)) for k in keys[2:])
      rates, weights = m.modes()
      chunk = m.chunk or 64
      scan = jax.jit(jax.grad(lambda *args: jnp.sum(frac_ops.frac_scan(
          *args, rates, weights, chunk=chunk)[0] ** 2), argnums=(0, 1, 2, 3)))
      row["scan_ms_per_layer"] = 1e3 * common.timed(scan, xs, dt, bb, cc, repeats=repeats)
      row["num_modes"] = int(m.num_modes)
    out[a] = row
    common.log(f"profile {a}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
  results.set("profile", {"load_before": before, "load_after": common.machine_load(),
                          "shape": [b, l, d], "repeats": repeats, "arms": out})


# ----------------------------------------------------------------------------- plot

def plot(results: common.Results, base, path) -> None:
  plt = common.pyplot()
  arms = list(base.experiment.order)
  runs = results.runs
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
  ax = axes[0]
  for i, a in enumerate(arms):
    vals = [r["val_loss_whole"] for r in runs.values() if r["arm"] == a]
    if vals:
      ax.scatter([i] * len(vals), vals, color=f"C{i}", s=18, alpha=0.6)
      ax.errorbar([i], [np.mean(vals)], yerr=[np.std(vals, ddof=1) if len(vals) > 1 else 0],
                  fmt="s", color=f"C{i}", capsize=5, markersize=8)
  ref = base.experiment.nanogpt_reference.val_loss
  ax.axhline(ref, color="gray", ls="--", lw=1, label=f"nanoGPT CPU recipe ({ref})")
  ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=8)
  ax.set_ylabel("whole-split validation loss (nats/char)")
  ax.set_title("Tiny Shakespeare, 2000 steps x 12 x 64")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  ax = axes[1]
  thr = results.data.get("throughput", {}).get("arms", {})
  for i, a in enumerate(arms):
    if a in thr:
      ax.bar(i, thr[a]["tokens_per_s"], color=f"C{i}", alpha=0.7)
    inrun = [r["tokens_per_s_in_run"] for r in runs.values() if r["arm"] == a]
    if inrun:
      ax.scatter([i] * len(inrun), inrun, color="k", s=14, zorder=3)
  ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=8)
  ax.set_ylabel("training tokens/s")
  ax.text(0.02, 0.97, "bars: side-by-side timing\ndots: in-run (shared, loaded CPU)",
          transform=ax.transAxes, va="top", fontsize=8)
  ax.set_title("Throughput, 2-core CPU, XLA path")
  ax.grid(alpha=0.3, axis="y")
  ax = axes[2]
  for i, a in enumerate(arms):
    curves = [r["curve"]["train"] for r in runs.values() if r["arm"] == a]
    if curves:
      n = min(len(c) for c in curves)
      steps = [c[0] for c in curves[0][:n]]
      loss = np.mean([[c[1] for c in cv[:n]] for cv in curves], axis=0)
      ax.plot(steps, loss, color=f"C{i}", label=a, lw=1.2)
  ax.set_ylim(1.2, 2.6)
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (mean over seeds, every 50th step)")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  common.savefig(fig, path)


# ----------------------------------------------------------------------------- main

def main(argv):
  del argv
  F = flags.FLAGS
  logging.set_verbosity(logging.WARNING)
  base = F.config
  arms = common.selected(base.experiment.order, F.only)
  seeds = common.seeds_from(F.seeds, base)
  name = common.experiment_name(base, NAME)
  results = common.Results(name, directory=F.results_dir)
  common.record_command(results)
  stages = F.stages.split(",")
  if "train" in stages:
    train_stage(base, arms, seeds, results, pathlib.Path(F.runs_dir))
  if "throughput" in stages:
    throughput_stage(base, arms, results)
  if "profile" in stages:
    profile_stage(base, arms, results)
  if "plot" in stages:
    plot(results, base, pathlib.Path(F.results_dir) / f"{name}.png")
  results.save()


if __name__ == "__main__":
  common.define_flags("configs/exp_lm_shakespeare.py", "train,throughput,profile,plot")
  app.run(main)
