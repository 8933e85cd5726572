"""Experiment 2: 3D segmentation of procedural cell volumes at CPU size, Pack3D against its
learned-position baseline, local-only attention, a parameter-matched 3D U-Net, and two
ablations (RoPE after compression, no log n_b bias).

  python -m experiments.seg3d_cpu --config=configs/exp_seg3d_cpu.py \
      [--stages=train,plot] [--only=unet3d] [--seeds=0]

Each (arm, seed) trains with train.seg3d_task (train.trainer.fit) in
runs/experiments/seg3d_cpu/<arm>/seed<k>; the macro Dice on the held-out volumes
(config.eval_batches batches of the evaluation stream, evaluated every config.eval_every
steps) gives "best" (max over evaluations) and "final" (last). Results in
results/seg3d_cpu.json after each run, the plot in results/seg3d_cpu.png.
"""

from __future__ import annotations

import copy
import pathlib
import time

import numpy as np
from absl import app, flags, logging

from experiments import common
from neurips26_jax.train import seg3d_task
from neurips26_jax.train.metrics import read_metrics

NAME = "seg3d_cpu"


def arm_config(base, arm: str, seed: int):
  c = copy.deepcopy(base)
  with c.unlocked():
    c.seed = seed
    c.model.update(base.experiment.arms[arm])          # nested options merge into the base's
    del c["experiment"]
  return c


def dice_curve(workdir: pathlib.Path) -> list:
  return [(r["step"] + 1, r["eval_dice"]) for r in read_metrics(workdir / "metrics.jsonl")
          if "eval_dice" in r]


def train_stage(base, arms, seeds, results, runs_dir) -> None:
  for seed in seeds:
    for arm in arms:
      key = common.run_key(arm, seed)
      if results.has(key):
        common.log(f"{key}: done already, skipped")
        continue
      config = arm_config(base, arm, seed)
      task = seg3d_task.build_task(config)         # prints the parameter count
      n = common.param_count(task.model)
      common.log(f"{key}: {type(task.model).__name__}, {n:,} parameters, "
                 f"model {config.model.to_dict()}")
      workdir = runs_dir / NAME / arm / f"seed{seed}"
      load0, t0 = common.machine_load(), time.perf_counter()
      fit = common.fit(config, workdir, task, key)
      wall = time.perf_counter() - t0
      curve = dice_curve(workdir)
      row = {"arm": arm, "seed": seed, "params": n, "model": type(task.model).__name__,
             "unet_base_channels": getattr(task.model, "down", None) and int(
                 task.model.down[0].convs[0].out_features),
             "steps": config.steps, "dice_best": max(d for _, d in curve),
             "dice_final": curve[-1][1], "dice_curve": curve, "eval_loss": fit.eval_loss,
             "final_train_loss": fit.final_loss, "steps_per_s": fit.steps_per_s,
             "wall_s": wall, "load_start": load0, "load_end": common.machine_load()}
      results.put(key, row)
      common.log(f"{key}: macro Dice best {row['dice_best']:.4f} final {row['dice_final']:.4f}"
                 f", wall {wall:.0f}s")


def plot(results, base, path) -> None:
  plt = common.pyplot()
  arms = [a for a in base.experiment.order if any(r["arm"] == a for r in results.runs.values())]
  fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
  ax = axes[0]
  for i, arm in enumerate(arms):
    rows = [r for r in results.runs.values() if r["arm"] == arm]
    for j, what in enumerate(("dice_best", "dice_final")):
      vals = [r[what] for r in rows]
      x = i + (j - 0.5) * 0.3
      ax.scatter([x] * len(vals), vals, color=f"C{i}", s=14, alpha=0.6,
                 marker="o" if j == 0 else "^")
      ax.errorbar([x], [np.mean(vals)], yerr=[np.std(vals, ddof=1) if len(vals) > 1 else 0],
                  fmt="s" if j == 0 else "D", color=f"C{i}", capsize=4,
                  markerfacecolor="white" if j else f"C{i}")
  ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=8)
  ax.set_ylabel("held-out macro Dice (left: best, right: final)")
  ax.grid(alpha=0.3, axis="y")
  ax.set_title("3D cell segmentation at CPU size")
  ax = axes[1]
  for i, arm in enumerate(arms):
    curves = [r["dice_curve"] for r in results.runs.values() if r["arm"] == arm]
    n = min(len(c) for c in curves)
    steps = [s for s, _ in curves[0][:n]]
    mean = np.mean([[d for _, d in c[:n]] for c in curves], axis=0)
    ax.plot(steps, mean, "o-", color=f"C{i}", label=arm, markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("held-out macro Dice (mean over seeds)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  common.savefig(fig, path)


def main(argv):
  del argv
  F = flags.FLAGS
  logging.set_verbosity(logging.WARNING)
  base = F.config
  arms = common.selected(base.experiment.order, F.only)
  seeds = common.seeds_from(F.seeds, base)
  results = common.Results(NAME, directory=F.results_dir)
  common.record_command(results)
  stages = F.stages.split(",")
  if "train" in stages:
    train_stage(base, arms, seeds, results, pathlib.Path(F.runs_dir))
  if "plot" in stages:
    plot(results, base, pathlib.Path(F.results_dir) / f"{NAME}.png")
  results.save()


if __name__ == "__main__":
  common.define_flags("configs/exp_seg3d_cpu.py", "train,plot")
  app.run(main)
