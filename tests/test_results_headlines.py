"""RESULTS.md's headline numbers, recomputed from the results/*.json they come from: a line
that no longer matches its json fails here."""

import json
import pathlib

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
  for text in (f"{min(kept):.2f}-{max(kept):.2f}", f"{min(slowest):.0f}-{max(slowest):.0f}"):
    assert text in RESULTS, f"RESULTS.md should say {text} (results/frac_extrapolate.json)"
