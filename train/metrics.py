"""Run outputs: metrics.jsonl, TensorBoard events, a progress bar, the loss-curve PNG.

metrics.jsonl holds one JSON object per logged step, e.g.
  {"step": 10, "loss": 2.31, "grad_norm": 0.8, "lr": 0.001, "steps_per_s": 5.2, ...}
and evaluation rows {"step": 10, "eval_loss": 2.40}. On resume, rows at or after the restored
step are dropped first, so the file always describes one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

import jax
import numpy as np


class MetricWriter:
  """Appends rows to workdir/metrics.jsonl and TensorBoard (workdir/tb); only process 0 writes."""

  def __init__(self, workdir: pathlib.Path, *, resume_step: int):
    self.path = workdir / "metrics.jsonl"
    self.active = jax.process_index() == 0
    self.tb = None
    if not self.active:
      return
    if self.path.exists():
      kept = [r for r in read_metrics(self.path) if r["step"] < resume_step]
      self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    from tensorboardX import SummaryWriter  # noqa: PLC0415  (heavy import, process 0 only)
    self.tb = SummaryWriter(str(workdir / "tb"))

  def write(self, step: int, row: dict) -> None:
    if not self.active:
      return
    row = {"step": step, **{k: float(v) for k, v in row.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(row) + "\n")
    for k, v in row.items():
      if k != "step":
        self.tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def read_metrics(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ProgressBar:
  """`[####....] step/total loss | steps/s tokens/s | eta` on stderr (redrawn on a terminal,
  one line per ~5% otherwise). Rates are measured from the first finished step (after compiling)."""

  def __init__(self, total: int, tokens_per_step: int, *, width: int = 24):
    self.total, self.tokens, self.width = total, tokens_per_step, width
    self.t0, self.first, self.last_line = None, None, 0
    self.tty = sys.stderr.isatty()
    self.rate = 0.0

  def update(self, step: int, loss: float) -> None:
    """After `step` (0-based) finished with `loss`."""
    done = step + 1
    if self.t0 is None:
      self.t0, self.first = time.perf_counter(), done
    elapsed = time.perf_counter() - self.t0
    self.rate = (done - self.first) / elapsed if elapsed > 0 else 0.0
    if not self.tty and done - self.last_line < max(1, self.total // 20) and done != self.total:
      return
    self.last_line = done
    filled = self.width * done // self.total
    eta = (self.total - done) / self.rate if self.rate else math.inf
    text = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
            f"loss {loss:.4f} | {self.rate:.2f} steps/s {self.rate * self.tokens:,.0f} tok/s"
            f" | eta {eta:.0f}s")
    sys.stderr.write(("\r" + text) if self.tty else text + "\n")
    sys.stderr.flush()

  def close(self) -> None:
    if self.tty:
      sys.stderr.write("\n")


def plot_losses(metrics_path: pathlib.Path, png_path: pathlib.Path) -> None:
  """Train loss (raw and a moving average over ~2% of the run), eval loss, against step (PNG)."""
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  rows = read_metrics(metrics_path)
  fig, ax = plt.subplots(figsize=(7, 4))
  steps, loss = zip(*[(r["step"], r["loss"]) for r in rows if "loss" in r])
  ax.plot(steps, loss, color="C0", alpha=0.3, label="loss")
  window = max(1, len(loss) // 50)
  if window > 1:
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, color="C0", label=f"loss ({window}-step mean)")
  evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
  if evals:
    ax.plot(*zip(*evals), "o-", color="C1", label="eval_loss", markersize=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=120)
  plt.close(fig)
