"""Markdown tables for RESULTS.md from results/*.json (what the tables there were made from).

  python -m experiments.report [--results_dir=results] > /tmp/tables.md
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

from experiments.common import fmt, paired_interval, stats


def _load(directory: pathlib.Path, name: str):
  path = directory / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def _table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def _by_arm(runs: dict, order) -> dict:
  out = {}
  for r in runs.values():
    out.setdefault(r["arm"], []).append(r)
  return {a: sorted(out[a], key=lambda r: r["seed"]) for a in order if a in out}


def _load_note(rows) -> str:
  loads = [r["load_start"]["load1"] for r in rows] + [r["load_end"]["load1"] for r in rows]
  return f"{min(loads):.1f}-{max(loads):.1f}"


def lm(d) -> str:
  order = ["attention_swiglu", "attention_flashffn", "frac_swiglu", "frac_flashffn",
           "mamba2_swiglu"]
  arms = _by_arm(d["runs"], order)
  thr = d.get("throughput", {}).get("arms", {})
  ref = stats([r["val_loss_whole"] for r in arms.get("attention_swiglu", [])])["mean"]
  rows = []
  for a, rs in arms.items():
    val = stats([r["val_loss_whole"] for r in rs])
    rows.append([
        f"`{a}`", f"{rs[0]['params']:,}", fmt(val, 4),
        "" if ref is None else f"{val['mean'] - ref:+.4f}",
        ", ".join(f"{r['val_loss_whole']:.4f}" for r in rs),
        fmt(stats([r["eval_loss_sampled"] for r in rs]), 3),
        f"{thr[a]['tokens_per_s']:,.0f}" if a in thr else "n/a",
        f"{np.mean([r['tokens_per_s_in_run'] for r in rs]):,.0f}",
        f"{np.mean([r['wall_s'] for r in rs]) / 60:.1f}", _load_note(rs)])
  out = [_table(["arm", "params", "val loss, whole split (mean ± sd)", "vs attn+SwiGLU",
                 "per seed (0, 1, 2)", "sampled eval (trainer)", "tokens/s side by side",
                 "tokens/s in run", "wall min/run", "load avg during runs"], rows)]
  if "throughput" in d:
    t = d["throughput"]
    out.append(f"\nSide-by-side timing: {t['rounds']} rounds x {t['steps_per_round']} steps per "
               f"arm, best round; load before {t['load_before']['load1']}, after "
               f"{t['load_after']['load1']}.")
  if "profile" in d:
    p = d["profile"]
    prow = []
    for a in order:
      if a not in p["arms"]:
        continue
      r = p["arms"][a]
      prow.append([f"`{a}`", f"{r['train_step_ms']:.1f}", f"{r['mixer_ms_per_layer']:.2f}",
                   f"{r['mixer_gflops_per_layer']:.3f}", f"{r['ffn_ms_per_layer']:.2f}",
                   f"{r['ffn_gflops_per_layer']:.3f}",
                   f"{r['ffn_reference_ms_per_layer']:.2f}" if "ffn_reference_ms_per_layer" in r
                   else "-",
                   f"{r['scan_ms_per_layer']:.2f}" if "scan_ms_per_layer" in r else "-",
                   r.get("num_modes", "-")])
    out.append("\n" + _table(["arm", "train step ms", "mixer fwd+bwd ms/layer",
                              "mixer GFLOP/layer", "FFN fwd+bwd ms/layer", "FFN GFLOP/layer",
                              "FlashFFN via einsum reference ms/layer", "scan alone ms/layer",
                              "modes"], prow))
    out.append(f"\nProfile at [B, L, d] = {p['shape']}, {p['repeats']} repeats; load before "
               f"{p['load_before']['load1']}, after {p['load_after']['load1']}.")
  return "\n".join(out)


def frac_memory(d) -> str:
  out = []
  order = ["frac", "mamba2_params", "mamba2_state", "attention"]
  for task in ("lag_recall", "value_recall", "mqar", "mqar_short"):
    runs = {k: r for k, r in d["runs"].items() if r["task"] == task}
    if not runs:
      continue
    arms = _by_arm(runs, order + sorted({r["arm"] for r in runs.values()} - set(order)))
    first = next(iter(arms.values()))[0]
    recall = "by_lag" in first
    field = "by_lag" if recall else "by_gap"
    labels = ([str(b["lag"]) for b in first[field]] if recall
              else [f"{b['lo']}-{b['hi'] - 1}" for b in first[field]])
    rows = []
    for a, rs in arms.items():
      acc = np.array([[b["accuracy"] if b["accuracy"] is not None else np.nan
                       for b in r[field]] for r in rs])
      rows.append([f"`{a}`", f"{rs[0]['params']:,}", rs[0]["state_per_layer"] or "KV cache",
                   rs[0]["steps"], fmt(stats([r["accuracy"] for r in rs]), 3)]
                  + [f"{x:.2f}" for x in np.nanmean(acc, 0)]
                  + [f"{np.mean([r['wall_s'] for r in rs]) / 60:.1f}"])
    head = ["arm", "params", "state/layer", "steps", "accuracy (all)"] + [
        ("lag " if recall else "gap ") + l for l in labels] + ["wall min"]
    out.append(f"**{task}**, L = {first['length']} (chance {first['chance']:.3f})\n\n"
               + _table(head, rows))
  if "kernels_at_init" in d:
    rows, lags = [], None
    for key, k in d["kernels_at_init"].items():
      if not key.startswith(("lag_recall/", "value_recall/")):
        continue
      lags = k["lags"][-4:] if lags is None else lags
      for h, row in enumerate(k["kernel_over_k0"]):
        rows.append([f"`{key}`", h, f"{k['alpha_init'][h]:.2f}", f"{k['dt_init'][h]:.2f}",
                     k["num_modes"]] + [f"{x:.4f}" for x in row[-4:]])
    if rows:
      out.append("**Memory kernel at initialisation** (`--stages=kernels`): K(lag)/K(0) per "
                 "head, u = lag x dt(init)\n\n" + _table(
                     ["task/arm", "head", "alpha", "dt", "modes"]
                     + [f"lag {l}" for l in lags], rows))
  if "dt_probe" in d:
    rows = []
    for key, probe in d["dt_probe"].items():
      for i, layer in enumerate(probe["layers"]):
        for h in range(len(layer["dt_distractors"])):
          rows.append([f"`{key}`", i, h, f"{layer['dt_value'][h]:.3f}",
                       f"{layer['dt_distractors'][h]:.3f}",
                       f"{layer['delta_t_longest_lag'][h]:.0f}",
                       f"{layer['kernel_over_k0_longest_lag'][h]:.3f}"])
    lag = next(iter(d["dt_probe"].values()))["longest_lag"]
    out.append(f"**Trained dt on value recall** (`--stages=dt`): Delta T = sum of dt from the "
               f"value to the query at lag {lag}\n\n" + _table(
                   ["task/arm/seed", "layer", "head", "dt at the value", "dt on distractors",
                    f"Delta T (lag {lag})", "K(Delta T)/K(0)"], rows))
  return "\n\n".join(out)


def _beyond(by_gap, lo: int) -> float | None:
  """Accuracy over the gap buckets starting at or beyond `lo` (weighted by their counts)."""
  sel = [b for b in by_gap if b["lo"] >= lo and b["n"]]
  n = sum(b["n"] for b in sel)
  return sum(b["accuracy"] * b["n"] for b in sel) / n if n else None


def frac_extrapolate(d) -> str:
  """Memory beyond the training length: the sweep, accuracy per gap bucket at each evaluation
  length, FRAC minus each baseline per seed with 95% t intervals, the memory clocks."""
  from experiments.frac_memory import rows_at_best_lr  # noqa: PLC0415
  out = []
  order = ["frac", "one_mode_exp", "mamba2_ssm_init", "frac_fixed_dt"]
  for task in dict.fromkeys(r["task"] for r in d["runs"].values()):
    runs = {k: r for k, r in d["runs"].items() if r["task"] == task}
    at_best = rows_at_best_lr(runs, task)
    arms = [a for a in order if a in at_best] + sorted(set(at_best) - set(order))
    first = next(iter(runs.values()))
    length = first["length"]
    lrs = d["meta"].get("lrs") or sorted({r["lr"] for r in runs.values() if "lr" in r})
    rows = []
    for a in arms:
      r0 = at_best[a][0]
      at = {r["lr"]: r for r in runs.values() if r["arm"] == a and r["seed"] == r0["seed"]}
      f = r0.get("flops_per_token") or {}
      rows.append([f"`{a}`", f"{r0['params']:,}", f"{f.get('weights', 0):,}",
                   f"{f['xla']:,}" if f.get("xla") else "n/a"]
                  + [("diverged" if at[lr].get("diverged") else
                      f"{at[lr]['eval_loss']:.4f} / {at[lr]['accuracy']:.3f}")
                     if lr in at else "-" for lr in lrs] + [f"{r0['lr']:g}"])
    out.append(f"**{task}**, trained at L = {length}, {first['steps']} steps x batch "
               f"{first['batch']}: learning-rate sweep (seed {at_best[arms[0]][0]['seed']}; "
               f"held-out loss / accuracy at L; best = lowest loss)\n\n" + _table(
                   ["arm", "params", "FLOPs/token (weights)", "FLOPs/token (XLA forward)"]
                   + [f"lr {lr:g}" for lr in lrs] + ["best lr"], rows))
    lengths = sorted({int(n) for rs in at_best.values() for r in rs
                      for n in (r.get("extrapolation") or {})})
    for n in lengths:
      rows, labels = [], None
      for a in arms:
        rs = [r for r in at_best[a] if r.get("extrapolation")]
        if not rs:
          continue
        buckets = [r["extrapolation"][str(n)]["by_gap"] for r in rs]
        labels = labels or [f"{b['lo']}-{b['hi'] - 1}" for b in buckets[0]]
        acc = np.array([[np.nan if b["accuracy"] is None else b["accuracy"] for b in bs]
                        for bs in buckets])
        rows.append([f"`{a}`", len(rs), fmt(stats([r["extrapolation"][str(n)]["accuracy"]
                                                  for r in rs]), 3)]
                    + [f"{x:.2f}" for x in np.nanmean(acc, 0)])
      out.append(f"Accuracy per gap bucket at {n} L = {n * length} (mean over seeds; chance "
                 f"{first['chance']:.3f})\n\n" + _table(
                     ["arm", "seeds", "all gaps"] + [f"gap {l}" for l in labels], rows))
    if lengths:
      longest = max(lengths)
      metrics = [(f"all gaps at L = {length}", lambda r: r["extrapolation"]["1"]["accuracy"]),
                 (f"gaps >= L at {longest} L",
                  lambda r: _beyond(r["extrapolation"][str(longest)]["by_gap"], length)),
                 (f"gaps >= 4L at {longest} L",
                  lambda r: _beyond(r["extrapolation"][str(longest)]["by_gap"], 4 * length))]
      rows = []
      for a in arms:
        rs = {r["seed"]: r for r in at_best[a] if r.get("extrapolation")}
        for name, metric in metrics:
          vals = {s: v for s, r in rs.items() if (v := metric(r)) is not None}
          if not vals:
            continue
          cells = [f"`{a}`", name, ", ".join(f"{vals[s]:.3f}" for s in sorted(vals))]
          if a != "frac" and "frac" in at_best:
            ref = {r["seed"]: metric(r) for r in at_best["frac"] if r.get("extrapolation")}
            diffs = [ref[s] - vals[s] for s in sorted(vals) if ref.get(s) is not None]
            cells += _diff_cells(diffs, 3)
          else:
            cells += ["-", "-"]
          rows.append(cells)
      out.append("Per seed, each arm at its best learning rate; difference = FRAC minus the "
                 "arm, same seed; 95% t interval over the seeds\n\n" + _table(
                     ["arm", "accuracy on", "per seed", "FRAC - arm per seed",
                      "mean [95% interval]"], rows))
    rows = []
    for a in arms:
      rs = [r for r in at_best[a] if r.get("memory_clock")]
      if not rs:
        continue
      for i, layer in enumerate(rs[0]["memory_clock"]["init"]):
        k = lambda m: max(row[-1] for row in m["kernel_over_k0"])
        init = layer
        trained = [r["memory_clock"]["trained"][i] for r in rs]
        rows.append([f"`{a}`", i, f"{max(init['timescale']):,.0f}", f"{k(init):.3g}",
                     ", ".join(f"{max(m['timescale']):,.0f}" for m in trained),
                     ", ".join(f"{k(m):.3g}" for m in trained),
                     ", ".join(f"{np.mean(m['dt_distractors']):.3f}" for m in trained)])
    if rows:
      gap = rs[0]["memory_clock"]["init"][0]["gaps"][-1]
      out.append("Memory clock (`memory_clock`; on held-out sequences of the longest length): "
                 "per layer the slowest head's timescale 1 / (slowest rate x mean dt over the "
                 "distractors) in tokens (FRAC: its slowest mode's; its kernel is a power law, "
                 f"so compare the kernels) and the largest kernel K/K(0) over the heads after "
                 f"{gap} distractors; at initialisation (seed 0) and trained (per seed)\n\n"
                 + _table(
                     ["arm", "layer", "slowest timescale, init", f"K({gap})/K(0), init",
                      "slowest timescale, trained", f"K({gap})/K(0), trained",
                      "mean dt on distractors, trained"], rows))
    versions = sorted({f"jax {r.get('jax', '?')}, flax {r.get('flax', '?')}, python "
                       f"{r.get('python', '?')}" for r in runs.values()})
    out.append(f"Software: {'; '.join(versions)}.")
  return "\n\n".join(out)


def _at_chosen_lr(runs: dict, best: dict) -> tuple[dict, str]:
  """The runs of each arm at one learning rate: its swept best once that rate has as many
  seeds as any other, else (sweep or seeds not finished) the rate with the most seeds; and a
  line saying which."""
  by_arm: dict = {}
  for r in runs.values():
    by_arm.setdefault(r["arm"], []).append(r)
  chosen, notes = {}, []
  for a, rs in by_arm.items():
    counts = {}
    for r in rs:
      counts[r["lr"]] = counts.get(r["lr"], 0) + 1
    most = max(counts, key=counts.get)
    lr = best[a] if a in best and counts[best[a]] == counts[most] else most
    chosen.update({k: r for k, r in runs.items() if r["arm"] == a and r["lr"] == lr})
    notes.append(f"{a} {lr:g}" + ("" if lr == best.get(a) else " (sweep pending)"
                                  if a not in best else f" (best {best[a]:g}: seeds pending)"))
  return chosen, "Learning rate of each arm's rows below: " + ", ".join(notes) + "."


def _at_one_rate(runs: dict, lrs, base: str) -> str:
  """Each arm minus `base` at every swept rate, both at that rate, same seed: whether the
  best-rate comparison also holds with one rate for everyone."""
  rows = []
  for lr in lrs:
    at: dict = {}
    for r in runs.values():
      if r.get("lr") == lr:
        at.setdefault(r["arm"], {})[r["seed"]] = r["acc_objects_train_layout"]
    for a, by_seed in at.items():
      if base in at and a != base and len(set(by_seed) & set(at[base])) > 1:
        rows.append([f"{lr:g}", f"`{a}`"] + _paired(by_seed, at[base], 3))
  return (f"Object accuracy (training layout) minus `{base}`'s with both at one rate, same "
          "seed; 95% t interval over the seeds\n\n"
          + _table(["lr", "arm", "per seed", "mean [95% interval]"], rows)) if rows else ""


def repacking(d) -> str:
  order = ["learned_packed", "rope_packed", "axial_rope", "none", "local_only", "dense",
           "far_offset", "levels2", "levels2_gain8"]
  runs, out = d["runs"], []
  lrs = d["meta"].get("lrs") or sorted({r["lr"] for r in runs.values() if "lr" in r})
  if len(lrs) > 1:  # swept: a sweep table, then every arm at its own best rate
    table, best, _ = _sweep_table(list(runs.values()), lrs, "acc_objects_train_layout",
                                  lower_is_better=False, digits=3)
    runs, note = _at_chosen_lr(runs, best)
    out += [table, note] + [t for t in [_at_one_rate(d["runs"], lrs, "local_only")] if t]
  arms = _by_arm(runs, order)
  layouts = ["raster_zyx", "raster_xyz", "morton", "hilbert", "cube_major", "shuffled_fields"]
  for name in ("train_shapes", "unseen_shapes"):
    rows = []
    for a, rs in arms.items():
      cell = lambda l, key: fmt(stats([r["eval"][name][l][key] for r in rs]), 3)
      rows.append([f"`{a}`", f"{rs[0]['params']:,}"] + [cell(l, "acc_objects") for l in layouts]
                  + [f"{max(r['eval'][name][l]['max_logit_change'] for r in rs for l in layouts):.2g}"])
    out.append(f"**{name.replace('_', ' ')}**: object-token accuracy per layout\n\n" + _table(
        ["arm", "params"] + layouts + ["max logit change vs raster_zyx"], rows))
  rows = []
  for a, rs in arms.items():
    for name in ("train_shapes", "unseen_shapes"):
      for l in ("raster_zyx", "hilbert"):
        e = [r["eval"][name][l] for r in rs]
        rows.append([f"`{a}`", name.replace("_", " "), l] + [
            fmt(stats([x[k] for x in e]), 3)
            for k in ("acc_tokens", "acc_objects", "acc_far_marker", "acc_near_surface")])
  out.append("Near / far decomposition (object tokens: marker class right = far; surface flag "
             "right = near)\n\n" + _table(["arm", "shapes", "layout", "all tokens", "objects",
                                           "far (marker class)", "near (surface)"], rows))
  if any(r.get("reach") for rs in arms.values() for r in rs):
    out.append(_reach_table(arms))
  # the far branch's worth (each arm minus local-only) and the default's (each minus axial
  # RoPE), same seed
  for base in ("local_only", "axial_rope"):
    if base not in arms:
      continue
    ref = {r["seed"]: r for r in arms[base]}
    rows = []
    for a, rs in arms.items():
      if a in ("local_only", base):
        continue
      for name in ("train_shapes", "unseen_shapes"):
        metric = lambda r: r["eval"][name]["raster_zyx"]["acc_objects"]
        diffs = [metric(r) - metric(ref[r["seed"]]) for r in rs if r["seed"] in ref]
        rows.append([f"`{a}`", name.replace("_", " ")] + _diff_cells(diffs, 3))
    if rows:
      out.append(f"Object accuracy (raster_zyx) minus `{base}`'s, same seed; 95% t interval "
                 "over the seeds\n\n" + _table(["arm", "shapes", "per seed",
                                                 "mean [95% interval]"], rows))
  walls = {a: np.mean([r["wall_s"] for r in rs]) / 60 for a, rs in arms.items()}
  speeds = {a: np.mean([r["steps_per_s"] for r in rs]) for a, rs in arms.items()}
  out.append("Wall time per run (min): " + ", ".join(f"{a} {w:.1f}" for a, w in walls.items())
             + "; training steps/s (mean over seeds, beside other jobs): "
             + ", ".join(f"{a} {v:.2f}" for a, v in speeds.items()))
  if "throughput" in d:
    out.append(_throughput_line(d["throughput"], order))
  return "\n\n".join(out)


def _reach_table(arms: dict) -> str:
  """The far part of each arm: the marker class with the far branch on and off (training
  shapes, raster layout), and (the reach stage) split by how the marker reaches the token."""
  rows = []
  for a, rs in arms.items():
    far = lambda r: r["eval"]["train_shapes"]["raster_zyx"]["acc_far_marker"]
    off = [r["far_off"]["train_shapes"]["raster_zyx"]["acc_far_marker"]
           for r in rs if r.get("far_off")]
    reach = [r["reach"] for r in rs if r.get("reach")]
    rows.append([f"`{a}`", fmt(stats([far(r) for r in rs]), 3),
                 fmt(stats(off), 3) if off else "n/a",
                 fmt(stats([x["level1"] for x in reach]), 3) if reach else "n/a",
                 fmt(stats([x["level2_only"] for x in reach]), 3) if reach else "n/a",
                 f"{reach[0]['tokens_level1']} / {reach[0]['tokens_level2_only']}" if reach
                 else "n/a", ", ".join(str(r["seed"]) for r in rs if r.get("reach")) or "-"])
  return ("The far part (marker class of object tokens; training shapes, raster_zyx): with "
          "the far branch switched off at inference, and split by how the marker reaches the "
          "token with levels = 2 (`--stages=reach`: through a level-1 summary, its level-2 "
          "cube within r_2 of the marker's, or only through a level-2 summary)\n\n"
          + _table(["arm", "far", "far branch off", "within level-1 reach",
                    "level-2 summary only", "tokens (seed 0)", "seeds split"], rows))


def _throughput_line(t: dict, order) -> str:
  """The side-by-side step times of `common.throughput`, each as a ratio to the first arm's."""
  arms = [a for a in order if a in t["arms"]]
  first = t["arms"][arms[0]]["step_ms_best"]
  times = ", ".join(f"`{a}` {t['arms'][a]['step_ms_best']:,.0f} ms "
                    f"({t['arms'][a]['step_ms_best'] / first:.2f}x)" for a in arms)
  return (f"Cost per train step, side by side ({t['rounds']} rounds x {t['steps_per_round']} "
          f"steps per arm, arms interleaved, best round; load before "
          f"{t['load_before']['load1']}, after {t['load_after']['load1']}): {times}.")


def seg3d(d) -> str:
  order = ["pack3d_axial_rope", "pack3d_learned", "local_only", "unet3d", "rope_after",
           "no_block_bias"]
  arms = _by_arm(d["runs"], order)
  ref = stats([r["dice_best"] for r in arms.get("pack3d_axial_rope", [])])["mean"]
  rows = []
  for a, rs in arms.items():
    best = stats([r["dice_best"] for r in rs])
    rows.append([f"`{a}`", f"{rs[0]['params']:,}", fmt(best, 4),
                 "" if ref is None else f"{best['mean'] - ref:+.4f}",
                 fmt(stats([r["dice_final"] for r in rs]), 4),
                 ", ".join(f"{r['dice_best']:.3f}/{r['dice_final']:.3f}" for r in rs),
                 f"{np.mean([r['wall_s'] for r in rs]) / 60:.1f}", _load_note(rs)])
  return _table(["arm", "params", "best macro Dice", "vs Pack3D axial", "final macro Dice",
                 "per seed best/final", "wall min/run", "load avg"], rows)


def _sweep_table(runs: list, lrs, metric: str, lower_is_better: bool, digits: int):
  """The learning-rate sweep at the first seed as a table, {arm: best lr} for the arms whose
  sweep is complete, and {arm: (best lr so far, rates run)} for the others that ran one."""
  arms = list(dict.fromkeys(r["arm"] for r in runs))
  first = min(r["seed"] for r in runs)
  pick = min if lower_is_better else max
  best, partial, rows = {}, {}, []
  for a in arms:
    scores = {r["lr"]: r[metric] for r in runs if r["arm"] == a and r["seed"] == first}
    at = {lr: scores[lr] for lr in lrs if lr in scores}  # in sweep order: ties go as the runner's
    if len(at) == len(lrs):
      best[a] = pick(at, key=at.get)
    elif at:
      partial[a] = (pick(at, key=at.get), len(at))
    r0 = next(r for r in runs if r["arm"] == a)
    rows.append([f"`{a}`", f"{r0['params']:,}",
                 f"{r0['flops_per_token']:,}" if "flops_per_token" in r0 else "n/a"]
                + [f"{at[lr]:.{digits}f}" if lr in at else "-" for lr in lrs]
                + [f"{best[a]:g}" if a in best else "pending"])
  table = (f"Learning-rate sweep (seed {first}; {metric}):\n\n"
           + _table(["arm", "params", "FLOPs/token"] + [f"lr {lr:g}" for lr in lrs]
                    + ["best lr"], rows))
  return table, best, partial


def _diff_cells(diffs: list, digits: int) -> list[str]:
  """Two table cells for paired differences: the per-seed values and "mean [95% interval]"."""
  ci = paired_interval(diffs)
  interval = ("n/a" if ci["low"] is None else
              f"{ci['mean']:+.{digits}f} [{ci['low']:+.{digits}f}, {ci['high']:+.{digits}f}]")
  return [", ".join(f"{x:+.{digits}f}" for x in diffs), interval]


def _paired(by_seed: dict, ref: dict, digits: int) -> list[str]:
  """`_diff_cells` of by_seed minus ref over the seeds both have."""
  return _diff_cells([by_seed[s] - ref[s] for s in sorted(by_seed) if s in ref], digits)


def at_best_rate(d, metric: str, lower_is_better: bool = True, digits: int = 4):
  """(the sweep's table, {arm: its rate as a label}, {arm: {seed: metric}} at that rate) for
  an experiment run by `common.sweep_then_seeds`: each arm at the best rate of the first
  seed's sweep, or the best of the rates it ran while its sweep is incomplete."""
  runs = list(d["runs"].values())
  lrs = d["meta"].get("lrs") or sorted({r["lr"] for r in runs})
  table, best, partial = _sweep_table(runs, lrs, metric, lower_is_better, digits)
  rate = {**best, **{a: lr for a, (lr, _) in partial.items()}}
  label = {**{a: f"{lr:g}" for a, lr in best.items()},
           **{a: f"{lr:g} (best of {n} run)" for a, (lr, n) in partial.items()}}
  at_best = {a: {r["seed"]: r[metric] for r in runs if r["arm"] == a and r["lr"] == rate[a]}
             for a in rate}
  return table, label, at_best


def sweep(d, metric: str, reference: str, *, against: tuple = (), lower_is_better: bool = True,
          digits: int = 4) -> str:
  """Tables for an experiment run by `common.sweep_then_seeds`: the learning-rate sweep at the
  first seed, then every arm at its best learning rate with the per-seed paired difference
  against `reference` (same seed) and its 95% t interval, then the same against each arm in
  `against` that ran. An arm whose sweep is incomplete is shown at the best of the rates it
  ran, marked so."""
  runs = list(d["runs"].values())
  table, label, at_best = at_best_rate(d, metric, lower_is_better, digits)
  out = [table]
  ref = at_best.get(reference, {})
  rows = [[f"`{a}`", label[a], ", ".join(f"{by_seed[s]:.{digits}f}" for s in sorted(by_seed)),
           fmt(stats(list(by_seed.values())), digits)]
          + (_paired(by_seed, ref, digits) if a != reference else ["-", "-"])
          for a, by_seed in at_best.items()]
  out += [f"\nAt each arm's best learning rate ({metric}; difference: arm minus `{reference}`,"
          f" same seed; 95% t interval over the seeds):\n",
          _table(["arm", "lr", "per seed", "mean ± sd", f"paired diff vs {reference}",
                  "mean diff [95% interval]"], rows)]
  for other in (o for o in against if o in at_best):
    rows = [[f"`{a}`"] + _paired(by_seed, at_best[other], digits)
            for a, by_seed in at_best.items() if a not in (reference, other)]
    out += [f"\nArm minus `{other}`, each at its best rate above (same seed; 95% t interval):\n",
            _table(["arm", f"paired diff vs {other}", "mean diff [95% interval]"], rows)]
  versions = sorted({f"jax {r.get('jax', '?')}, python {r.get('python', '?')}" for r in runs})
  out.append(f"\nSoftware: {'; '.join(versions)}.")
  return "\n".join(out)


def lm_ffn(d) -> str:
  """SwiGLU as the reference; the other FlashFFN head widths also against the default's (128)
  where every run used one Python (the stdlib corpus is the running interpreter's library, so
  rows of two Pythons are on two corpora)."""
  one_corpus = len({r.get("python") for r in d["runs"].values()}) == 1
  return sweep(d, "val_loss_whole", "swiglu", against=("flashffn_h128",) if one_corpus else ())


def main(argv) -> None:
  directory = pathlib.Path("results")
  for a in argv[1:]:
    if a.startswith("--results_dir="):
      directory = pathlib.Path(a.split("=", 1)[1])
  for name, fn in (("lm_shakespeare", lm), ("lm_ffn_shakespeare", lm_ffn),
                   ("lm_ffn_stdlib", lm_ffn), ("lm_ffn_stdlib_py312", lm_ffn),
                   ("lm_ffn_large_shakespeare", lm_ffn),
                   ("frac_memory_diag", frac_memory),
                   ("frac_memory", frac_memory), ("frac_extrapolate", frac_extrapolate),
                   ("repacking", repacking), ("far3d", repacking), ("far3d_levels", repacking),
                   ("far3d_levels_sweep", repacking), ("far3d_levels_long", repacking),
                   ("seg3d_cpu", seg3d)):
    d = _load(directory, name)
    if d is None:
      continue
    print(f"## {name}\n\nCommand: `{d['meta'].get('command', '')}`\n\n{fn(d)}\n")


if __name__ == "__main__":
  main(sys.argv)
