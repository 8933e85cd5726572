"""RESULTS.md's headline numbers, recomputed from the results/*.json they come from: a line
that no longer matches its json fails here."""

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = (ROOT / "RESULTS.md").read_text()


def _runs_at_best_lr(path: str, task: str, arm: str) -> list[dict]:
  """An arm's runs at its chosen rate: seed 0 swept the rates, the other seeds ran the best."""
  runs = [r for r in json.loads((ROOT / path).read_text())["runs"].values()
          if r["task"] == task and r["arm"] == arm]
  best = {r["lr"] for r in runs if r["seed"] > 0}
  assert len(best) == 1, (arm, best)
  return [r for r in runs if r["lr"] in best]


def test_memory_clock_ranges_over_every_seed():
  """FRAC's trained kernel at 2048 tokens (its slowest head, per layer) and the one-mode
  layer's slowest timescale, over all seeds at each arm's best rate (section 3d)."""
  frac = _runs_at_best_lr("results/frac_extrapolate.json", "kv_recall", "frac")
  one_mode = _runs_at_best_lr("results/frac_extrapolate.json", "kv_recall", "one_mode_exp")
  assert len({r["seed"] for r in frac}) == len({r["seed"] for r in one_mode}) == 6
  kept = [max(head[-1] for head in layer["kernel_over_k0"])
          for r in frac for layer in r["memory_clock"]["trained"]]
  slowest = [max(layer["timescale"]) for r in one_mode for layer in r["memory_clock"]["trained"]]
  text = " ".join(RESULTS.split())
  for claim, want in ((r"power[- ]law (?:kernel )?keeps (\d\.\d+-\d\.\d+)",
                       f"{min(kept):.2f}-{max(kept):.2f}"),
                      (r"slowest timescale after training is (\d+-\d+)",
                       f"{min(slowest):.0f}-{max(slowest):.0f}")):
    said = re.findall(claim, text)
    assert said and set(said) == {want}, f"RESULTS.md says {said}, the json {want}"


INTERVAL = r"([+-]?\d+\.\d+),? (?:95% interval )?\[([+-]?\d+\.\d+), ([+-]?\d+\.\d+)\]"


def test_every_headline_interval_is_printed_by_the_report():
  """Each "mean [low, high]" of RESULTS.md's headlines is one the report code computes from
  results/*.json (`python -m experiments.report`), at the precision the headline shows."""
  import contextlib
  import io

  from experiments import report
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    report.main(["report", f"--results_dir={ROOT / 'results'}"])
  computed = [tuple(map(float, m)) for m in re.findall(INTERVAL, " ".join(printed.getvalue().split()))]
  text = " ".join(RESULTS.split())
  start = text.index("**Headlines**")
  headlines = text[start:text.index(" ## ", start)]
  found = list(re.finditer(INTERVAL, headlines))
  assert len(found) >= 10
  for m in found:
    digits = [len(x.split(".")[1]) for x in m.groups()]
    assert any(all(round(c[i], digits[i]) == float(m.group(i + 1)) for i in range(3))
               for c in computed), f"RESULTS.md headline {m.group(0)!r} is not in the report"
