"""Run outputs: metrics.jsonl, TensorBoard events, a progress bar, the loss-curve PNG.

metrics.jsonl holds one JSON object per logged step, e.g.
  {"step": 10, "loss": 2.31, "grad_norm": 0.8, "lr": 0.001, "steps_per_s": 5.2, ...}
and evaluation rows {"step": 10, "eval_loss": 2.40}. On resume, rows at or after the restored
step are dropped first (TensorBoard hides its old events there too), so both describe one
uninterrupted run. A last line torn by a kill is dropped with a warning. Both files are written
through at every row, so a killed run loses no logged row.

Hand-written on purpose: clu's metric writers and periodic actions would be the library pieces,
but clu (0.0.12) imports TensorFlow in `clu.metric_writers` and `clu.periodic_actions`, a far
larger dependency than this file; and tensorboardX's SummaryWriter hands events to a background
thread whose flush() does not wait for them, so it loses the last rows at a kill. The event file
is therefore written here, synchronously, with tensorboardX's record writer and protos.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import socket
import sys
import time

import jax
import numpy as np
from absl import logging


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
      trimmed = self.path.with_name(self.path.name + ".tmp")   # a kill here keeps the old file
      trimmed.write_text("".join(json.dumps(r) + "\n" for r in kept))
      trimmed.replace(self.path)
    self.tb = _EventFile(workdir / "tb", restart_step=resume_step)

  def write(self, step: int, row: dict) -> None:
    if not self.active:
      return
    row = {"step": step, **{k: float(v) for k, v in row.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(row) + "\n")
    self.tb.write(step, {k: v for k, v in row.items() if k != "step"})

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


class _EventFile:
  """A TensorBoard event file of scalars, each row on disk when `write` returns."""

  def __init__(self, directory: pathlib.Path, *, restart_step: int):
    # a slow import, done by process 0 only
    from tensorboardX import record_writer, summary  # noqa: PLC0415
    from tensorboardX.proto import event_pb2  # noqa: PLC0415
    self._event, self._scalar = event_pb2.Event, summary.scalar
    directory.mkdir(parents=True, exist_ok=True)
    name = f"events.out.tfevents.{time.time_ns()}.{socket.gethostname()}"   # sorts by time
    self.file = record_writer.RecordWriter(str(directory / name))
    self._write(file_version="brain.Event:2")
    if restart_step:   # TensorBoard hides older files' events at and after a restart's step
      start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
      self._write(step=restart_step, session_log=start)
    self.file.flush()

  def _write(self, **fields) -> None:
    self.file.write(self._event(wall_time=time.time(), **fields).SerializeToString())

  def write(self, step: int, scalars: dict) -> None:
    for k, v in scalars.items():
      self._write(step=step, summary=self._scalar(k, v))
    self.file.flush()

  def close(self) -> None:
    self.file.close()


def read_metrics(path: pathlib.Path) -> list[dict]:
  """The rows of a metrics.jsonl; a torn last line (a kill mid-write) is dropped with a warning,
  a bad line elsewhere is a ValueError naming the file and line."""
  lines = [(i, line) for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
  rows = []
  for n, (i, line) in enumerate(lines, 1):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      if n < len(lines):
        raise ValueError(f"{path}:{i} is not a JSON row ({e}): {line[:80]!r}") from None
      logging.warning("%s: dropping the torn last line %d (%r)", path, i, line[:80])
  return rows


class ProgressBar:
  """`[####....] step/total loss | steps/s tokens/s | eta` on stderr (redrawn on a terminal,
  one line per ~5% otherwise); silent unless `active` (process 0 of a multi-host run).

  `rate` (steps/s) counts training time only: it is measured from the first finished step
  (after compiling), and the time spent inside `paused()` (evaluation, checkpointing) is left
  out. It is None until two steps have finished; until then the line shows no rates or eta.
  """

  def __init__(self, total: int, tokens_per_step: int, *, width: int = 24, active: bool = True):
    self.total, self.tokens, self.width, self.active = total, tokens_per_step, width, active
    self.t0, self.first, self.last_line, self.excluded = None, None, 0, 0.0
    self.tty = active and sys.stderr.isatty()
    self.rate: float | None = None

  @contextlib.contextmanager
  def paused(self):
    """Time spent in this block is not training time: kept out of `rate`."""
    start = time.perf_counter()
    try:
      yield
    finally:
      self.excluded += time.perf_counter() - start

  def update(self, step: int, loss: float) -> None:
    """After `step` (0-based) finished with `loss`."""
    done = step + 1
    if self.t0 is None:
      self.t0, self.first, self.excluded = time.perf_counter(), done, 0.0
    elapsed = time.perf_counter() - self.t0 - self.excluded
    if done > self.first and elapsed > 0:
      self.rate = (done - self.first) / elapsed
    if not self.active:
      return
    if not self.tty and done - self.last_line < max(1, self.total // 20) and done != self.total:
      return
    self.last_line = done
    filled = self.width * done // self.total
    text = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} loss {loss:.4f}"
    if self.rate is not None:
      text += (f" | {self.rate:.2f} steps/s {self.rate * self.tokens:,.0f} tok/s"
               f" | eta {(self.total - done) / self.rate:.0f}s")
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
