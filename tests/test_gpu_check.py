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


def test_block_sweep_candidates_name_every_block_size():
  """Each candidate of the GPU block sweep sets every BlockSizes field, in order (a new
  field left out would be silently dropped by zip)."""
  import dataclasses

  from benchmarks import gpu_tune_flash_ffn as tune
  from neurips26_jax.pallas_kernels.flash_ffn.blocks import BlockSizes
  assert tune.FIELDS == tuple(f.name for f in dataclasses.fields(BlockSizes))
  assert all(len(c) == len(tune.FIELDS) for cands in tune.CANDIDATES.values() for c in cands)


def test_gpu_benchmark_times_the_warp_specialized_forward_on_hopper():
  """On Hopper the FlashFFN GPU check runs the warp-specialized forward beside the bodies
  backend=None can pick; not on Blackwell, where it does not exist."""
  import jax.numpy as jnp

  from benchmarks import gpu_flash_ffn as bench
  from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available, target_chip
  if not mosaic_gpu_available():
    return
  with target_chip("gpu-h100"):
    hopper = bench.bodies()
    assert set(bench.bodies(jnp.float32)) == {"triton"}
  with target_chip("gpu-b200"):
    blackwell = bench.bodies()
  assert {n: kw.get("compute_wgs") for n, kw in hopper.items()} == {
      "triton": None, "mosaic_gpu": None, "mosaic_gpu ws": 2, "mosaic_gpu ws bi64": 2}
  assert set(blackwell) == {"triton", "mosaic_gpu"}
