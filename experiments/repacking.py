"""Pack3D segmenters on the geometry task (experiments.geometry_task): trained on one packing
layout (raster zyx), evaluated under every layout of jaxops.packing and on field shapes not
seen in training. Two experiments use it:

  python -m experiments.repacking --config=configs/exp_repacking.py   # positions vs relayout
  python -m experiments.repacking --config=configs/exp_far3d.py       # far context

  [--stages=train,throughput,reach,plot] [--only=axial_rope] [--seeds=0]

An arm is a dict of Pack3DAttention options over the config's (a plain string is a
`position`). With config.experiment.lrs, every arm is swept over those learning rates at the
first seed and run at its best for the other seeds (`common.sweep_then_seeds`, by object
accuracy on the training layout). Per run: results/<config.experiment.name>.json gets, for each
evaluation set (training shapes, unseen shapes) and layout, the token metrics of
`geometry_task.token_metrics` and the largest |logit| change against the training layout
(after undoing the permutation); and, for joint-merge arms, the same metrics with the far
branch switched off at inference (the trained weights with merge="local"). The throughput
stage times one train step per arm side by side (`common.throughput`: arms interleaved,
config.experiment.throughput_rounds x throughput_steps, after waiting for an idle machine)
into the json's "throughput" section: an arm's cost per step. The reach stage (for the
multi-level experiment) restores every finished run's checkpoint and splits its marker-class
accuracy by how the marker reaches an object token when levels = 2 (`marker_reach`): through
a level-1 summary, or only through a level-2 one; stored in the run's row as "reach".
"""

from __future__ import annotations

import copy
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from experiments import common, geometry_task
from neurips26_jax.jaxops import pack3d_levels, packing
from neurips26_jax.models.seg3d import Pack3DSegmenter
from neurips26_jax.train import inference, trainer
from neurips26_jax.train.losses import masked_cross_entropy

NAME = "repacking"


def arm_options(base, arm: str) -> dict:
  """The Pack3DAttention options of `arm` (over the config's attention_options)."""
  spec = base.experiment.arms[arm]
  extra = {"position": spec} if isinstance(spec, str) else dict(spec)
  return {**base.model.attention_options.to_dict(), "max_len": base.data.num_tokens, **extra}


def make_model(config, attention: dict, seed: int) -> Pack3DSegmenter:
  m = config.model
  return Pack3DSegmenter(
      patch=(1, 1, 1), in_channels=geometry_task.CHANNELS,
      num_classes=geometry_task.NUM_CLASSES, d_model=m.d_model, depth=m.depth,
      num_heads=m.num_heads, ffn="swiglu", ffn_options={"d_ff": m.d_ff},
      attention_options=attention, impl="xla",
      rngs=nnx.Rngs(jax.random.key(seed, impl="rbg")))


def loss_fn(model, batch):
  logits = model(batch["tokens"], batch["coords"], batch["field_ids"])[:, :, 0]
  loss, accuracy = masked_cross_entropy(logits, batch["labels"], batch["mask"])
  return loss, {"accuracy": accuracy}


def make_batch(config, seed: int, stream: int, index: int, shapes) -> dict:
  d = config.data
  return geometry_task.batch(seed=seed, stream=stream, index=index, items=config.batch_size,
                             fields_per_item=d.fields_per_item, shapes=[tuple(s) for s in shapes],
                             block_shape=tuple(config.model.attention_options.block_shape),
                             num_tokens=d.num_tokens, marker=d.get("marker", "token"))


def eval_batches(config, seed: int, shapes) -> list[dict]:
  """The evaluation batches of a run (their own stream, fields drawn from `shapes`)."""
  return [make_batch(config, 20_000 + seed, 1, i, shapes)
          for i in range(config.experiment.eval_batches)]


def logits_fn(model):
  """batch -> the model's logits [B, N, classes] as numpy (one jitted forward)."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args)[:, :, 0])
  return lambda b: np.asarray(forward(state, b["tokens"], b["coords"], b["field_ids"]))


def evaluate(model, config, seed: int) -> dict:
  """{eval set: {layout: metrics + max |logit change| vs raster_zyx}}."""
  logits = logits_fn(model)
  block = tuple(config.model.attention_options.block_shape)
  sets = {"train_shapes": config.data.shapes, "unseen_shapes": config.data.eval_shapes}
  out = {}
  for name, shapes in sets.items():
    batches = eval_batches(config, seed, shapes)
    base = [logits(b) for b in batches]
    rows = {}
    for layout in packing.LAYOUTS:
      preds, labels, masks, diff = [], [], [], 0.0
      for b, ref in zip(batches, base):
        nb, perms = geometry_task.relayout(b, layout, block_shape=block, seed=seed)
        lg = logits(nb)
        ref_perm = np.stack([ref[i][p] for i, p in enumerate(perms)])
        real = nb["mask"] > 0
        diff = max(diff, float(np.abs(lg - ref_perm)[real].max()))
        preds.append(lg.argmax(-1))
        labels.append(nb["labels"])
        masks.append(nb["mask"])
      m = geometry_task.token_metrics(np.concatenate(preds), np.concatenate(labels),
                                      np.concatenate(masks))
      rows[layout] = {**m, "max_logit_change": diff}
    out[name] = rows
  return out


def local_twin(config, attention: dict, seed: int) -> Pack3DSegmenter:
  """The abstract model of a joint-merge arm with its far branch off (merge="local"): the
  same parameters; the local branch alone has no far levels, so their options are dropped."""
  options = {k: v for k, v in attention.items() if k not in pack3d_levels.OPTIONS}
  return nnx.eval_shape(lambda: make_model(config, {**options, "merge": "local"}, seed))


def far_ablation(model, config, attention: dict, seed: int) -> dict | None:
  """evaluate() of the trained weights with the far branch off (`local_twin`); None for arms
  that are not joint."""
  if attention.get("merge", "joint") != "joint":
    return None
  local = local_twin(config, attention, seed)
  nnx.update(local, nnx.state(model))
  return evaluate(local, config, seed)


def train_stage(base, arms, seeds, results, runs_dir) -> None:
  common.sweep_then_seeds(base, arms, seeds, results,
                          lambda arm, lr, seed: _train_one(base, results, runs_dir, arm, lr, seed),
                          "acc_objects_train_layout", lower_is_better=False)


def _train_one(base, results, runs_dir, arm: str, lr: float, seed: int) -> None:
  label = common.run_label(base, arm, lr)
  key = common.run_key(label, seed)
  if results.has(key):
    common.log(f"{key}: done already, skipped")
    return
  config = copy.deepcopy(base)
  with config.unlocked():
    config.seed = seed
    config.optim.lr = lr
  attention = arm_options(base, arm)
  model = make_model(config, attention, seed)
  n = common.param_count(model)
  spec = base.experiment.arms[arm]
  spec = spec if isinstance(spec, str) else spec.to_dict()
  common.log(f"{key}: {spec}, {n:,} parameters")
  task = trainer.Task(
      model=model, loss_fn=loss_fn,
      train_batch=lambda step, c=config, s=seed: make_batch(c, s, 0, step, c.data.shapes),
      eval_batch=lambda i, c=config, s=seed: make_batch(c, s, 1, i, c.data.shapes),
      tokens_per_batch=config.batch_size * config.data.num_tokens)
  workdir = runs_dir / common.experiment_name(base, NAME) / label / f"seed{seed}"
  load0, t0 = common.machine_load(), time.perf_counter()
  fit = common.fit(config, workdir, task, key)
  wall = time.perf_counter() - t0
  t1 = time.perf_counter()
  ev = evaluate(fit.model, config, seed)
  ablated = far_ablation(fit.model, config, attention, seed)
  results.put(key, {"arm": arm, "lr": lr, "seed": seed, "options": spec,
                    "position": attention["position"], "params": n, "steps": config.steps,
                    "final_train_loss": fit.final_loss, "eval_loss": fit.eval_loss,
                    "steps_per_s": fit.steps_per_s, "wall_s": wall,
                    "eval_wall_s": time.perf_counter() - t1, "load_start": load0,
                    "load_end": common.machine_load(), "eval": ev, "far_off": ablated,
                    "acc_objects_train_layout": ev["train_shapes"]["raster_zyx"]["acc_objects"],
                    **common.versions()})
  tr = ev["train_shapes"]
  common.log(f"{key}: object accuracy " + ", ".join(
      f"{l} {tr[l]['acc_objects']:.3f}" for l in packing.LAYOUTS)
      + f"; far-marker part {tr['raster_zyx']['acc_far_marker']:.3f}"
      + ("" if ablated is None else
         f" ({ablated['train_shapes']['raster_zyx']['acc_far_marker']:.3f} with far off)")
      + f"; unseen shapes {ev['unseen_shapes']['raster_zyx']['acc_objects']:.3f}"
      + f"; wall {wall:.0f}s")


def plot(results, base, path) -> None:
  plt = common.pyplot()
  arms = [a for a in base.experiment.order if any(r["arm"] == a for r in results.runs.values())]
  sets = ("train_shapes", "unseen_shapes")
  fig, axes = plt.subplots(1, 2, figsize=(15, 4.8), sharey=True)
  layouts = list(packing.LAYOUTS)
  width = 0.8 / max(1, len(arms))
  for ax, name in zip(axes, sets):
    for i, arm in enumerate(arms):
      rows = [r["eval"][name] for r in results.runs.values() if r["arm"] == arm]
      acc = np.array([[row[l]["acc_objects"] for l in layouts] for row in rows])
      x = np.arange(len(layouts)) + (i - (len(arms) - 1) / 2) * width
      ax.bar(x, acc.mean(0), width, color=f"C{i}", label=arm,
             yerr=acc.std(0, ddof=1) if len(rows) > 1 else None, capsize=2)
    ax.set_xticks(range(len(layouts)), [l.replace("_", "\n") for l in layouts], fontsize=8)
    ax.set_title(f"{name.replace('_', ' ')} (trained on raster_zyx, "
                 f"{'seen' if name == 'train_shapes' else 'unseen'} field shapes)")
    ax.set_ylabel("object-token accuracy (5 classes)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, axis="y")
  axes[0].legend(fontsize=8)
  common.savefig(fig, path)


def throughput_stage(base, arms, results) -> None:
  e = base.experiment
  batch = {k: jnp.asarray(v) for k, v in make_batch(base, 0, 0, 0, base.data.shapes).items()}
  steps = {a: (*common.make_train_step(make_model(base, arm_options(base, a), 0), loss_fn,
                                       base.optim, base.steps), batch) for a in arms}
  results.set("throughput", common.throughput(
      steps, base.batch_size * base.data.num_tokens, e.get("throughput_rounds", 2),
      e.get("throughput_steps", 5)))


def marker_reach(batch: dict, block_shape, level_radius: int) -> np.ndarray:
  """bool [B, N]: True where the token's level-2 cube is within `level_radius` (Chebyshev) of
  the level-2 cube holding its field's marker, i.e. with levels = 2 the marker's level-1
  summary is among the token's far summaries; False where only a level-2 summary (the mean of
  8 cubes, one the marker's) carries it. Level-2 cube = (coords // block) >> 1 per axis."""
  cube2 = (batch["coords"] // np.asarray(block_shape)) >> 1                      # [B, N, 3]
  marked = batch["tokens"][..., 1:3].sum(-1) > 0
  out = np.zeros(batch["field_ids"].shape, bool)
  for b in range(len(out)):
    for f in np.unique(batch["field_ids"][b][marked[b]]):
      field = batch["field_ids"][b] == f
      marker = cube2[b][marked[b] & field][0]
      out[b] = np.where(field, np.abs(cube2[b] - marker).max(-1) <= level_radius, out[b])
  return out


def reach_stage(base, arms, results, runs_dir) -> None:
  """Every finished run of `arms`: marker-class accuracy on object tokens (training shapes,
  raster layout, the evaluation batches) where the marker is within level-1 reach and where
  only a level-2 summary carries it (`marker_reach`, r_2 = radius_blocks)."""
  block = tuple(base.model.attention_options.block_shape)
  radius = base.model.attention_options.get("radius_blocks", 1)
  for key, row in sorted(results.runs.items()):
    if row["arm"] not in arms:
      continue
    workdir = (runs_dir / common.experiment_name(base, NAME)
               / common.run_label(base, row["arm"], row["lr"]) / f"seed{row['seed']}")
    model = make_model(base, arm_options(base, row["arm"]), row["seed"])
    logits = logits_fn(inference.restore_params(model, workdir)[0])
    right, near = [], []
    for b in eval_batches(base, row["seed"], base.data.shapes):
      objects = (b["mask"] > 0) & (b["labels"] > 0)
      right.append(geometry_task.marker_class_right(logits(b).argmax(-1), b["labels"])[objects])
      near.append(marker_reach(b, block, radius)[objects])
    right, near = np.concatenate(right), np.concatenate(near)
    reach = {"level1": float(right[near].mean()), "level2_only": float(right[~near].mean()),
             "tokens_level1": int(near.sum()), "tokens_level2_only": int((~near).sum())}
    results.put(key, {**row, "reach": reach})
    common.log(f"{key}: marker class {reach['level1']:.3f} within level-1 reach "
               f"({reach['tokens_level1']} tokens), {reach['level2_only']:.3f} beyond "
               f"({reach['tokens_level2_only']})")


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
  if "reach" in stages:
    reach_stage(base, arms, results, pathlib.Path(F.runs_dir))
  if "plot" in stages:
    plot(results, base, pathlib.Path(F.results_dir) / f"{name}.png")
  results.save()


if __name__ == "__main__":
  common.define_flags("configs/exp_repacking.py", "train,plot")
  app.run(main)
