"""What the binary tests (tests/test_cli.py) share: the repository root and the pattern of a
DeprecationWarning the suite does not allow in a subprocess's output."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
_OURS = ("neurips26_jax", "jaxops", "pallas_kernels", "models", "train", "experiments", "configs",
         "benchmarks")
# What Python prints for a DeprecationWarning from our packages or from JAX (the suite's
# policy in pyproject.toml, for code that runs in a subprocess), less the Triton notice.
_DEPRECATION = re.compile(
    rf"^(?:{re.escape(str(REPO))}/(?:{'|'.join(_OURS)})/|\S*/site-packages/jax/)\S*:\d+: "
    r"DeprecationWarning: (?!The Pallas Triton backend is deprecated)", re.M)
