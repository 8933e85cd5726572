"""benchmarks/gpu_check.sh runs every benchmarks/gpu_*.py module, each with its time limit."""

import pathlib
import re

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_gpu_module_is_run_and_limited():
  script = (BENCH / "gpu_check.sh").read_text()
  listed = re.search(r"\|\| modules=\(([^)]*)\)", script).group(1).split()
  limits = set(re.findall(r"\[(gpu_\w+)\]=\d+", script))
  modules = {p.stem for p in BENCH.glob("gpu_*.py")}
  assert sorted(listed) == sorted(modules) and limits == modules, (listed, limits, modules)
