"""The Results page's figures and tables, drawn from the repository's records at build time
(docs/conf.py calls `render`), so no figure or number on the page is typed by hand:

  speed     benchmarks/aot/perf.json: each kernel against the baseline a user would pick, by
            libtpu's static cycle estimate (a schedule for a TPU, not a timing)
  quality   results/lm_ffn_*.json: FlashFFN minus SwiGLU in held-out loss, per-seed paired
            differences at each arm's best learning rate, with 95% t intervals
  step      benchmarks/aot/step_estimate.json: the paper-size LMs' train step on a v5e-16
            slice (sum of single-chip static estimates, collectives modelled)

  python docs/figures.py build/figures      # the figures and tables alone
  python docs/figures.py --readme           # README.md's summary rows that have a record
"""

from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- results-summary:begin -->", "<!-- results-summary:end -->"
COMPILE = ROOT / "benchmarks" / "aot" / "results.json"
PERF = ROOT / "benchmarks" / "aot" / "perf.json"
STEP = ROOT / "benchmarks" / "aot" / "step_estimate.json"
QUALITY = ["lm_ffn_shakespeare", "lm_ffn_large_shakespeare", "lm_ffn_stdlib_py312"]

# (what a user would run, the baseline they would otherwise run), programs of perf.json.
SPEED_PAIRS = [
    ("FlashFFN kernels vs XLA SwiGLU (same FLOPs)", "flash_ffn/kernels", "flash_ffn/swiglu"),
    ("FlashFFN layer vs SwiGLU layer", "layer/flash_ffn", "layer/swiglu"),
    ("FRAC kernel vs its XLA chunked scan", "frac/kernel", "frac/xla"),
    ("Pack3D kernels vs dense attention", "pack3d/kernels", "pack3d/dense"),
]


def speed_rows(perf: list[dict]) -> list[dict]:
  """One row per (pair, chip, direction, dtype) where both programs have a cycle estimate:
  ratio = baseline cycles / ours (above 1: ours is faster)."""
  ok = {(r["program"], r["target"], r["direction"], r["dtype"]): r["cycles"]
        for r in perf if r.get("status") == "ok" and not r.get("blocks")}
  rows = []
  for label, ours, base in SPEED_PAIRS:
    for (program, target, direction, dtype), cycles in ok.items():
      if program == ours and (base, target, direction, dtype) in ok:
        rows.append(dict(pair=label, target=target, direction=direction, dtype=dtype,
                         ours=cycles, base=ok[base, target, direction, dtype],
                         ratio=ok[base, target, direction, dtype] / cycles))
  return rows


def quality_rows(records: dict[str, dict]) -> list[dict]:
  """FlashFFN arms minus SwiGLU (val_loss_whole, nats per byte; below 0: FlashFFN better)."""
  sys.path.insert(0, str(ROOT))
  from experiments.common import paired_interval  # noqa: PLC0415
  from experiments.report import at_best_rate  # noqa: PLC0415
  rows = []
  for name, d in records.items():
    _, label, at_best = at_best_rate(d, "val_loss_whole")
    ref = at_best.get("swiglu", {})
    for arm, by_seed in at_best.items():
      seeds = sorted(set(by_seed) & set(ref))
      if arm == "swiglu" or len(seeds) < 2:
        continue
      ci = paired_interval([by_seed[s] - ref[s] for s in seeds])
      rows.append(dict(experiment=name, arm=arm, lr=label[arm], seeds=len(seeds), **ci))
  return rows


def step_rows(estimates: list[dict]) -> list[dict]:
  """Each estimated step against attention + SwiGLU of the same size, context and remat."""
  key = lambda r: (r["config"], r["context"], r.get("remat"))
  base = {key(r): r for r in estimates
          if r["mixer"] == "attention" and r["ffn"] == "swiglu" and "step_ms" in r}
  rows = []
  for r in estimates:
    b = base.get(key(r))
    rows.append(dict(config=r["config"].split(":")[-1], model=f"{r['mixer']} + {r['ffn']}",
                     context=r["context"], remat=r.get("remat") or "-",
                     step_ms=r.get("step_ms"), error=r.get("error", "").split("\n")[0][:80],
                     vs_base=(None if b is None or "step_ms" not in r else
                              [x / y for x, y in zip(r["step_ms"], b["step_ms"])])))
  return rows


def readme_rows() -> str:
  """README's summary rows computed from the records (ratios as time ours / baseline, so
  below 1 is faster), one markdown row each."""
  sys.path.insert(0, str(ROOT))
  from benchmarks.aot.check import verdict  # noqa: PLC0415
  compiled = json.loads(COMPILE.read_text())
  passed = sum(not verdict(r) for r in compiled)
  targets = sorted({r["target"] for r in compiled})
  speed = speed_rows(json.loads(PERF.read_text()))
  time = lambda pair, target, direction, dtype="bfloat16": next(
      (f"{r['ours'] / r['base']:.2f}x" for r in speed if r["pair"].startswith(pair)
       and (r["target"], r["direction"], r["dtype"]) == (target, direction, dtype)), "n/a")
  at_125m = [r for r in step_rows(json.loads(STEP.read_text())) if r["config"] == "125m"]
  steps = [r for r in at_125m if r["remat"] == "mixer" and r["step_ms"]]
  step_cells = "; ".join(f"{r['model']} {_range(r['step_ms'], '{:.1f}')} ms"
                         + (f" ({_range(r['vs_base'], '{:.2f}x')})"
                            if r["model"] != "attention + swiglu" else "") for r in steps)
  missing = sorted(r["model"] for r in at_125m if r["error"])
  rows = [
      ("Kernels through the real compilers, fwd + grad, f32 + bf16 (`make compile-check`; "
       f"{', '.join(targets)})", f"{passed}/{len(compiled)} cases pass"),
      ("FlashFFN kernels' time vs a FLOP-matched XLA SwiGLU, 370M head shape, 4k tokens, "
       "bf16 (libtpu static estimate, not a timing)",
       f"v5e: fwd {time('FlashFFN kernels', 'tpu-v5e', 'fwd')}, fwd+bwd "
       f"{time('FlashFFN kernels', 'tpu-v5e', 'fwd+bwd')}; v6e: fwd "
       f"{time('FlashFFN kernels', 'tpu-v6e', 'fwd')}, fwd+bwd "
       f"{time('FlashFFN kernels', 'tpu-v6e', 'fwd+bwd')}; the layer's forward vs SwiGLU's "
       f"layer {time('FlashFFN layer', 'tpu-v5e', 'fwd')} (v5e)"),
      ("FRAC kernel's time vs its XLA chunked scan, bf16 (libtpu static estimate)",
       f"v5e: fwd {time('FRAC', 'tpu-v5e', 'fwd')}, fwd+bwd "
       f"{time('FRAC', 'tpu-v5e', 'fwd+bwd')}; v6e: fwd {time('FRAC', 'tpu-v6e', 'fwd')}, "
       f"fwd+bwd {time('FRAC', 'tpu-v6e', 'fwd+bwd')}"),
      ("The 125M LMs' train step on v5e-16, 4k context, remat \"mixer\" (sum of single-chip "
       "static estimates, collectives modelled)",
       step_cells + (f"; not compiled: {', '.join(missing)}" if missing else "")),
  ]
  return "\n".join(["| item | number |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def _range(xs, fmt: str) -> str:
  """A [low, high] estimate as "low-high" in `fmt` ("-" when there is none)."""
  return "-" if xs is None else "-".join(fmt.format(x) for x in xs)


def _table(header: list[str], rows: list[list]) -> str:
  return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                   + ["| " + " | ".join(map(str, r)) + " |" for r in rows]) + "\n"


def _plot_speed(rows, path):
  import matplotlib.pyplot as plt  # noqa: PLC0415
  short = {"bfloat16": "bf16", "float32": "f32"}
  labels = [f"{r['pair'].split(' vs ')[0]}, {r['direction']}, {short[r['dtype']]}, "
            f"{r['target'].removeprefix('tpu-')}" for r in rows]
  fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.2))
  colors = ["tab:blue" if r["target"] == "tpu-v5e" else "tab:orange" for r in rows]
  ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=colors)
  ax.axvline(1.0, color="k", lw=0.8)
  ax.set_yticks(range(len(rows)), labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xscale("log")
  ax.set_xlabel("baseline cycles / ours (libtpu static estimate, not a timing; > 1: faster)")
  ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange")],
            labels=["TPU v5e", "TPU v6e"], fontsize=7, loc="lower right")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def _plot_quality(rows, path):
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
  for i, r in enumerate(rows):
    ax.errorbar(r["mean"], i, xerr=[[r["mean"] - r["low"]], [r["high"] - r["mean"]]],
                fmt="o", color="tab:green" if r["high"] < 0 else "tab:gray", capsize=3)
  ax.axvline(0.0, color="k", lw=0.8)
  ax.set_yticks(range(len(rows)), [f"{r['experiment'].removeprefix('lm_ffn_')}: {r['arm']}"
                                   for r in rows], fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("held-out loss, arm minus SwiGLU (nats/byte; mean and 95% interval over seeds)")
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def render(out: pathlib.Path) -> None:
  """Writes speed.svg, quality.svg and tables.md into `out`; tables.md is included by a page
  in out's parent (its image paths start with out's name)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  out.mkdir(parents=True, exist_ok=True)
  speed = speed_rows(json.loads(PERF.read_text()))
  quality = quality_rows({n: json.loads((ROOT / "results" / f"{n}.json").read_text())
                          for n in QUALITY})
  steps = step_rows(json.loads(STEP.read_text()))
  _plot_speed(speed, out / "speed.svg")
  _plot_quality(quality, out / "quality.svg")
  text = [
      "## Speed: each kernel against what it replaces\n",
      f"```{{image}} {out.name}/speed.svg\n:alt: speed ratios\n```\n",
      "Source: `benchmarks/aot/perf.json` (`python -m benchmarks.aot.perf`): libtpu's static "
      "cycle estimate of the compiled program for a TPU, a schedule and not a timing. No chip "
      "timing is recorded as data yet, so none is drawn.\n",
      _table(["comparison", "chip", "direction", "dtype", "ours (cycles)", "baseline (cycles)",
              "baseline / ours"],
             [[r["pair"], r["target"], r["direction"], r["dtype"], f"{r['ours']:,}",
               f"{r['base']:,}", f"{r['ratio']:.2f}x"] for r in speed]),
      "## Quality: FlashFFN against SwiGLU at matched parameters\n",
      f"```{{image}} {out.name}/quality.svg\n:alt: quality differences\n```\n",
      "Source: `results/lm_ffn_*.json` (`python -m experiments.lm_shakespeare`, see "
      "the repository's RESULTS.md): each arm at its own best learning rate, the same seeds; "
      "green where the whole interval is below 0.\n",
      _table(["experiment", "arm", "lr", "seeds", "mean", "95% interval"],
             [[r["experiment"], r["arm"], r["lr"], r["seeds"], f"{r['mean']:+.4f}",
               f"[{r['low']:+.4f}, {r['high']:+.4f}]"] for r in quality]),
      "## The paper-size models' train step on TPU v5e-16\n",
      "Source: `benchmarks/aot/step_estimate.json` (`python -m benchmarks.aot.step_estimate`): "
      "the sum of single-chip static estimates with the collectives modelled, as a range; "
      "a row that did not compile says why.\n",
      _table(["model size", "model", "context", "remat", "step (ms)",
              "vs attention + SwiGLU", "did not compile"],
             [[r["config"], r["model"], r["context"], r["remat"],
               _range(r["step_ms"], "{:.1f}"), _range(r["vs_base"], "{:.2f}x"),
               r["error"] or "-"] for r in steps]),
  ]
  (out / "tables.md").write_text("\n".join(text))


if __name__ == "__main__":
  if sys.argv[1:] == ["--readme"]:
    sys.path.insert(0, str(ROOT))
    from tools.readme_section import replace_section  # noqa: PLC0415
    replace_section(README, BEGIN, END, readme_rows())
  else:
    render(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "figures")
