"""Runs a training binary the way a user would, for the one-step smoke tests."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
_OURS = ("neurips26_jax", "jaxops", "pallas_kernels", "models", "train", "experiments", "configs",
         "benchmarks")
# What Python prints for a DeprecationWarning from our packages or from JAX (the suite's
# policy in pyproject.toml, for code that runs in a subprocess), less the Triton notice.
_DEPRECATION = re.compile(
    rf"^(?:{re.escape(str(REPO))}/(?:{'|'.join(_OURS)})/|\S*/site-packages/jax/)\S*:\d+: "
    r"DeprecationWarning: (?!The Pallas Triton backend is deprecated)", re.M)


def run_one_step(module: str, config: str, workdir) -> subprocess.CompletedProcess:
  """`python -m module --config=config --config.steps=1 --workdir=workdir` on CPU; asserts rc 0
  and no DeprecationWarning from our code or JAX."""
  cmd = [sys.executable, "-m", module, f"--config={config}", "--config.steps=1",
         f"--workdir={workdir}"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu",
                            "PYTHONWARNINGS": "default::DeprecationWarning"})
  assert out.returncode == 0, out.stderr[-3000:]
  deprecated = [line for line in out.stderr.splitlines() if _DEPRECATION.match(line)]
  assert not deprecated, "\n".join(deprecated)
  return out
