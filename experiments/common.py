"""What the experiment runners share: a results file that resumes arm by arm, statistics,
machine-load snapshots, timing (side-by-side train steps too) and the absl entry point.

results/<name>.json = {"experiment": name, "meta": {...}, "runs": {"<arm>/seed<k>": {...}},
                       ...other sections a runner adds (throughput, profile, ...)}
It is rewritten atomically after every finished run, so a killed runner loses at most the run
in progress (whose trainer checkpoints let it resume).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

RESULTS_DIR = pathlib.Path("results")
RUNS_DIR = pathlib.Path("runs/experiments")


def param_count(model: nnx.Module) -> int:
  return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def machine_load() -> dict:
  """The 1/5/15-minute load averages and the time (the machine is shared: say how loaded)."""
  one, five, fifteen = os.getloadavg()
  return {"load1": round(one, 2), "load5": round(five, 2), "load15": round(fifteen, 2),
          "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def versions() -> dict:
  """The software a run used (every results row records it)."""
  import flax  # noqa: PLC0415
  return {"jax": jax.__version__, "flax": flax.__version__,
          "python": ".".join(map(str, sys.version_info[:3]))}


def stats(values) -> dict:
  """{"mean", "std" (ddof=1; 0 for one value), "min", "max", "n"} of a list of numbers."""
  v = np.asarray([x for x in values if x is not None], np.float64)
  if v.size == 0:
    return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else 0.0,
          "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def fmt(s: dict, digits: int = 3) -> str:
  """'mean ± std' (or just the mean for one value)."""
  if s["mean"] is None:
    return "n/a"
  if s["n"] > 1:
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f}"
  return f"{s['mean']:.{digits}f}"


class Results:
  """results/<name>.json, loaded if present, saved atomically on every change."""

  def __init__(self, name: str, *, directory: pathlib.Path | str = RESULTS_DIR):
    self.path = pathlib.Path(directory) / f"{name}.json"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      self.data = json.loads(self.path.read_text())
    else:
      self.data = {"experiment": name, "meta": {}, "runs": {}}
    self.data.setdefault("runs", {})
    self.data.setdefault("meta", {})

  @property
  def runs(self) -> dict:
    return self.data["runs"]

  def has(self, key: str) -> bool:
    return key in self.runs

  def put(self, key: str, value: dict) -> None:
    self.runs[key] = value
    self.save()

  def set(self, section: str, value) -> None:
    self.data[section] = value
    self.save()

  def save(self) -> None:
    """Atomic. Runs and sections that another process wrote to the file since this one loaded
    it are kept (two runners of one experiment, e.g. on different arms, can share the file;
    this process's own entries win)."""
    if self.path.exists():
      disk = json.loads(self.path.read_text())
      for key, run in disk.get("runs", {}).items():
        self.runs.setdefault(key, run)
      for section, value in disk.items():
        self.data.setdefault(section, value)
    tmp = self.path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(self.data, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, self.path)


def run_key(arm: str, seed: int) -> str:
  return f"{arm}/seed{seed}"


def experiment_name(base, default: str) -> str:
  """The results file's and the workdirs' name: config.experiment.name, else `default`."""
  return base.experiment.get("name", None) or default


def sweep_lrs(base) -> tuple:
  """The learning rates every arm is tried at (config.experiment.lrs; default: the config's)."""
  return tuple(base.experiment.get("lrs", None) or (base.optim.lr,))


def run_label(base, arm: str, lr: float) -> str:
  """`arm` when the experiment has one learning rate, else `arm@lr<lr>`."""
  return arm if len(sweep_lrs(base)) == 1 else f"{arm}@lr{lr:g}"


def best_lr(base, results: "Results", arm: str, seed: int, metric: str,
            lower_is_better: bool = True) -> float | None:
  """The swept learning rate with the best `metric` of `arm` at `seed` (None until every one
  has run)."""
  scores = {}
  for lr in sweep_lrs(base):
    key = run_key(run_label(base, arm, lr), seed)
    if not results.has(key):
      return None
    scores[lr] = results.runs[key][metric]
  return (min if lower_is_better else max)(scores, key=scores.get)


def sweep_then_seeds(base, arms, seeds, results: "Results", run_one: Callable, metric: str,
                     lower_is_better: bool = True) -> None:
  """The runner skeleton: run_one(arm, lr, seed) for every arm at every swept learning rate with
  the first seed, then for the other seeds at each arm's best learning rate (by `metric` at the
  first seed). run_one skips runs already in `results` (resume)."""
  for arm in arms:
    for lr in sweep_lrs(base):
      run_one(arm, lr, seeds[0])
  for seed in seeds[1:]:                  # seed-major: a partial run still covers every arm
    for arm in arms:
      run_one(arm, best_lr(base, results, arm, seeds[0], metric, lower_is_better), seed)


# Two-sided 95% quantiles of Student's t by degrees of freedom.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228}


def paired_interval(diffs) -> dict:
  """Mean of per-seed paired differences with its 95% t interval:
  {"mean", "low", "high", "n"} (low/high None for fewer than 2 pairs)."""
  d = np.asarray(diffs, np.float64)
  if d.size < 2:
    return {"mean": float(d.mean()) if d.size else None, "low": None, "high": None,
            "n": int(d.size)}
  half = _T975.get(d.size - 1, 1.96) * d.std(ddof=1) / math.sqrt(d.size)
  return {"mean": float(d.mean()), "low": float(d.mean() - half),
          "high": float(d.mean() + half), "n": int(d.size)}


def fit(config, workdir, task, key: str):
  """trainer.fit(config, workdir, task); a run stopped by SIGTERM/SIGINT (its checkpoint saved)
  ends the runner with exit status 1 instead of being recorded as finished: rerunning the same
  command resumes it."""
  from neurips26_jax.train import trainer  # noqa: PLC0415
  result = trainer.fit(config, workdir, task)
  if result.stopped:
    log(f"{key}: stopped by {result.stopped} at a checkpoint; not recorded (rerun to resume)")
    raise SystemExit(1)
  return result


def log(*args) -> None:
  print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def timed(fn: Callable, *args, repeats: int, warmup: int = 2):
  """Seconds per call of fn(*args) (blocking on the result), after `warmup` calls."""
  out = None
  for _ in range(warmup):
    out = fn(*args)
  jax.block_until_ready(out)
  t = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / repeats


# ----------------------------------------------------------------------------- throughput

def make_train_step(model: nnx.Module, loss_fn: Callable, optim_config, steps: int):
  """(jitted step(params, opt_state, batch) -> (params, opt_state, loss), params, opt_state):
  the trainer's update (`train.optim.make_optimizer`: clipping and AdamW) on
  loss_fn(model, batch)[0], without sharding or metrics: what the throughput stages time."""
  import optax  # noqa: PLC0415
  from neurips26_jax.train import optim  # noqa: PLC0415
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optim.make_optimizer(optim_config, steps)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(nnx.merge(graphdef, p, rest), batch)[0])(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, params, tx.init(params)


def wait_for_idle(threshold: float, max_wait_s: int) -> dict:
  """Waits (up to max_wait_s) for a 1-minute load average below `threshold`; the load then."""
  t0 = time.time()
  while os.getloadavg()[0] >= threshold and time.time() - t0 < max_wait_s:
    time.sleep(20)
  return {**machine_load(), "waited_s": round(time.time() - t0),
          "idle": os.getloadavg()[0] < threshold}


def throughput(steps: dict, tokens_per_step: int, rounds: int, per_round: int) -> dict:
  """Side-by-side timing of train steps: `steps` maps arm -> (step, params, opt_state, batch)
  (`make_train_step` and one batch). Every arm is compiled and warmed up, then after
  `wait_for_idle` (--idle_load, --idle_wait_s) `rounds` rounds of `per_round` steps per arm,
  arms interleaved within a round; each arm's best round is its time. Returns the results'
  "throughput" section."""
  from absl import flags  # noqa: PLC0415
  state = {}
  for arm, (fn, params, opt_state, batch) in steps.items():      # compile and warm up
    for _ in range(3):
      params, opt_state, loss = fn(params, opt_state, batch)
    jax.block_until_ready(loss)
    state[arm] = (params, opt_state)
  before = wait_for_idle(flags.FLAGS.idle_load, flags.FLAGS.idle_wait_s)
  log(f"throughput: load {before}")
  times = {arm: [] for arm in steps}
  for _ in range(rounds):
    for arm, (fn, _, _, batch) in steps.items():
      params, opt_state = state[arm]
      t = time.perf_counter()
      for _ in range(per_round):
        params, opt_state, loss = fn(params, opt_state, batch)
      jax.block_until_ready(loss)
      times[arm].append((time.perf_counter() - t) / per_round)
      state[arm] = (params, opt_state)
  rows = {arm: {"step_ms_best": 1e3 * min(t), "step_ms_all": [1e3 * x for x in t],
                "tokens_per_s": tokens_per_step / min(t)} for arm, t in times.items()}
  for arm, r in rows.items():
    log(f"throughput {arm}: {r['step_ms_best']:.1f} ms/step, {r['tokens_per_s']:,.0f} tok/s")
  return {"load_before": before, "load_after": machine_load(), "steps_per_round": per_round,
          "rounds": rounds, "tokens_per_step": tokens_per_step, "arms": rows}


def command_line() -> str:
  return " ".join(["python -m " + sys.modules["__main__"].__spec__.name
                   if getattr(sys.modules["__main__"], "__spec__", None) else sys.argv[0]]
                  + sys.argv[1:])


def record_command(results: "Results") -> None:
  """meta.command = this invocation; meta.commands = every invocation, with its time (a
  later --stages=plot must not hide the command that trained)."""
  line = command_line()
  results.data["meta"]["command"] = line
  results.data["meta"].setdefault("commands", []).append(
      {"command": line, "time": time.strftime("%Y-%m-%d %H:%M:%S")})


def selected(items, only: str) -> list:
  """items filtered by a comma-separated --only list (empty: all)."""
  if not only:
    return list(items)
  wanted = only.split(",")
  unknown = [w for w in wanted if w not in items]
  if unknown:
    raise ValueError(f"--only names unknown arms {unknown}; known: {list(items)}")
  return [i for i in items if i in wanted]


def savefig(fig, path: pathlib.Path) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  import matplotlib.pyplot as plt  # noqa: PLC0415
  plt.close(fig)


def pyplot():
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  return plt


def define_flags(default_config: str, stages: str) -> None:
  """The runners' shared flags; called under `if __name__ == "__main__"` only, so that
  importing a runner (tests, other runners) defines no absl flags."""
  from absl import flags  # noqa: PLC0415
  from ml_collections import config_flags  # noqa: PLC0415
  config_flags.DEFINE_config_file("config", default_config, "Experiment config.")
  flags.DEFINE_string("stages", stages, "Comma-separated stages to run.")
  flags.DEFINE_string("only", "", "Comma-separated arms (default: all).")
  flags.DEFINE_string("seeds", "", "Comma-separated seeds (default: the config's).")
  flags.DEFINE_string("results_dir", str(RESULTS_DIR), "Where the json and png go.")
  flags.DEFINE_string("runs_dir", str(RUNS_DIR), "Where the training workdirs go.")
  flags.DEFINE_float("idle_load", 0.5, "Load average a throughput stage waits for.")
  flags.DEFINE_integer("idle_wait_s", 1800, "Longest wait for that load (s).")


def seeds_from(flag_value: str, config) -> list[int]:
  return ([int(s) for s in flag_value.split(",")] if flag_value
          else list(config.experiment.seeds))
