"""Runs a training binary the way a user would, for the one-step smoke tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_one_step(module: str, config: str, workdir) -> subprocess.CompletedProcess:
  """`python -m module --config=config --config.steps=1 --workdir=workdir` on CPU; asserts rc 0."""
  cmd = [sys.executable, "-m", module, f"--config={config}", "--config.steps=1",
         f"--workdir={workdir}"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  return out
