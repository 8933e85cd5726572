"""Compiles cases for one target; run inside that target's venv (see check.py).

  python -m benchmarks.aot.worker --target=gpu-h200 --cases="flash_ffn/370m/fwd/float32;..."

Prints one line per case: `START <case>` before it, then `RESULT <json>`. The backend's
own reports (ptxas -v on stderr; XLA dumps; Mosaic GPU's dumps) are captured per case and
parsed here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import sys
import tempfile
import time

from benchmarks.aot import cases as cases_lib
from benchmarks.aot import report
from benchmarks.aot.targets import TARGETS, environment

def _cpu_seconds() -> float:
  """CPU time of this process (all threads) and its finished children (ptxas): unlike wall
  time it does not grow when other jobs share the machine."""
  own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                        resource.RUSAGE_CHILDREN))
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@contextlib.contextmanager
def _stderr_to(path: pathlib.Path):
  """Redirects file descriptor 2 (where XLA's C++ logging and ptxas -v go) to a file."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "w") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


def _ptxas_first_on_path() -> None:
  """Mosaic GPU runs the first ptxas on PATH (XLA finds the venv's own): the venv's."""
  try:
    import nvidia.cuda_nvcc
  except ImportError:
    return
  bin_dir = pathlib.Path(list(nvidia.cuda_nvcc.__path__)[0]) / "bin"
  os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


@contextlib.contextmanager
def _gpu_target(target, mesh):
  """What a Mosaic GPU compile needs to be for the described GPU and not the host: the
  target as default device (or Mosaic assumes compute capability 9.0) and its per-block
  shared-memory limit (or Mosaic checks against the CPU device's)."""
  import jax
  try:
    from jax.experimental.mosaic.gpu import core as mosaic_gpu_core
    limit = mosaic_gpu_core.artificial_shared_memory_limit(target.on_chip_limit)
  except (ImportError, AttributeError):  # a JAX without it (0.10): no Mosaic GPU kernels
    limit = contextlib.nullcontext()
  with jax.default_device(mesh.devices.flat[0]), limit:
    yield


def compile_case(target, mesh, case: cases_lib.Case) -> dict:
  import jax
  from jax.sharding import NamedSharding, PartitionSpec

  result = {"case": case.name, "target": target.name, "expect_failure": case.expect_failure}
  fn, specs = cases_lib.build(case, target.kind)
  try:  # tiles tuned for this chip (pallas_kernels.dispatch reads jax.devices() otherwise)
    from neurips26_jax.pallas_kernels.dispatch import target_chip
    chip = target_chip(target.name)
  except ImportError:  # a tree from before the tuned tables
    chip = contextlib.nullcontext()
  sharding = NamedSharding(mesh, PartitionSpec())
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in specs]
  with tempfile.TemporaryDirectory() as tmp:
    dump, log = pathlib.Path(tmp) / "dump", pathlib.Path(tmp) / "stderr.txt"
    # Mosaic GPU reads MOSAIC_GPU_DUMP_TO once per process (main sets it): empty it per case.
    mosaic_dump = pathlib.Path(os.environ.get("MOSAIC_GPU_DUMP_TO", pathlib.Path(tmp) / "none"))
    for path in mosaic_dump.glob("*"):
      path.unlink()
    gpu = _gpu_target(target, mesh) if target.kind == "gpu" else contextlib.nullcontext()
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    try:
      with _stderr_to(log), chip, gpu, jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).lower(*args).compile({"xla_dump_to": str(dump)})
    except Exception as e:  # noqa: BLE001  (the compiler's verdict is the result)
      result.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                    compile_s=time.perf_counter() - start, cpu_s=_cpu_seconds() - cpu_start)
      if target.kind == "gpu" and (n := report.requested_shared_memory(str(e))):
        result["requested_shared_memory"] = n
      return result
    result.update(compile_s=time.perf_counter() - start, cpu_s=_cpu_seconds() - cpu_start)
    memory = compiled.memory_analysis()
    result.update(status="ok", hbm_temp=memory.temp_size_in_bytes,
                  hbm_args=memory.argument_size_in_bytes, hbm_out=memory.output_size_in_bytes)
    ours = lambda d: {k: v for k, v in d.items() if k.startswith(case.kernel_prefix)}
    if target.kind == "tpu":
      kernels = {k: {"vmem": v} for k, v in ours(report.tpu_scoped_vmem(dump)).items()}
    else:
      kernels = {k: dict(v) for k, v in ours(report.ptxas(log.read_text())).items()}
      for k, smem in ours(report.gpu_shared_memory(dump)).items():
        kernels.setdefault(k, {})["smem"] = smem
      kernels.update(ours(report.mosaic_gpu(mosaic_dump)))
    result["kernels"] = kernels
  return result


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--target", required=True, choices=sorted(TARGETS))
  parser.add_argument("--cases", required=True, help="case names separated by semicolons")
  args = parser.parse_args(argv)
  target = TARGETS[args.target]
  for key, value in environment(target).items():
    os.environ.setdefault(key, value)
  if target.kind == "gpu":
    _ptxas_first_on_path()
  with tempfile.TemporaryDirectory() as mosaic_dump:
    if target.kind == "gpu":  # before jax starts: Mosaic GPU reads it once
      os.environ["MOSAIC_GPU_DUMP_TO"] = mosaic_dump
    _compile_all(target, args.cases.split(";"))


def _compile_all(target, names):
  from benchmarks.aot.targets import device_mesh
  mesh = device_mesh(target)
  for name in names:
    print("START", name, flush=True)
    result = compile_case(target, mesh, cases_lib.parse(name))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
