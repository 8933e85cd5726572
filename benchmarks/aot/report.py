"""Parsers for what the backend compilers report about each Pallas kernel.

- ptxas -v (GPU; on stderr when TF_CPP_VMODULE=subprocess_compilation=3): registers per
  thread, spill stores/loads and stack frame bytes, ptxas time, per entry function.
- XLA GPU dump `*thunk_sequence.txt`: shared memory per kernel launch.
- XLA TPU dump `*after_codegen.txt`: the scoped VMEM each Mosaic custom call uses.
- Mosaic GPU dump (MOSAIC_GPU_DUMP_TO): per kernel module `<name>_<i>.ptxas` (ptxas -v for
  its entry function `<name>_mosaic_gpu_kernel`) and `<name>_<i>.resources.txt` (its
  `smem_scratch_bytes`). XLA's thunk sequence shows only a custom call for these.
Kernels are named by the `name=` given to `pl.pallas_call` (`kernel_name=` of `plgpu.kernel`).
"""

from __future__ import annotations

import pathlib
import re

from benchmarks.aot.sass import dump_report as mosaic_gpu_sass

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_TIME = re.compile(r"Compile time = ([\d.]+) ms")
_THUNK = re.compile(r"\] (\S+) grid: \[[^\]]*\] threads: \[[^\]]*\]\s+shared_memory: (\d+) bytes")
# A Mosaic kernel is a tpu_custom_call, or (when XLA fuses an update of its output into it) a
# kCustom fusion made from the pallas_call.
_TPU_CALL = re.compile(r"%([\w.-]+) = .*(?:custom_call_target=\"tpu_custom_call\""
                       r"|kind=kCustom, calls=.*op_name=\"[^\"]*pallas_call\")")
_SCOPED = re.compile(r"\"used_scoped_memory_configs\":\[([^\]]*)\]")
_SIZE = re.compile(r"\"size\":\"(\d+)\"")
_REQUESTED = re.compile(r"requested (\d+)")
_MOSAIC_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")
_MOSAIC_SMEM_ERROR = re.compile(r"exceeds available shared memory: smem_bytes=(\d+)")


def ptxas(text: str) -> dict:
  """{entry function: {registers, stack, spill_stores, spill_loads, ptxas_ms}} from ptxas -v."""
  kernels, current = {}, None
  for line in text.splitlines():
    if m := _PTXAS_ENTRY.search(line):
      current = kernels.setdefault(m.group(1), {})
    elif current is None:
      continue
    elif m := _PTXAS_FRAME.search(line):
      current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                     spill_loads=int(m.group(3)))
    elif m := _PTXAS_REGS.search(line):
      current["registers"] = int(m.group(1))
    elif m := _PTXAS_TIME.search(line):
      current["ptxas_ms"] = float(m.group(1))
  return kernels


def gpu_shared_memory(dump: pathlib.Path) -> dict:
  """{kernel: shared memory bytes per block} from the XLA dump's thunk sequences."""
  out = {}
  for path in dump.glob("*thunk_sequence*.txt"):
    for m in _THUNK.finditer(path.read_text()):
      out[m.group(1)] = max(out.get(m.group(1), 0), int(m.group(2)))
  return out


def tpu_scoped_vmem(dump: pathlib.Path) -> dict:
  """{kernel: scoped VMEM bytes} for every Mosaic custom call in the TPU dump."""
  out = {}
  for path in dump.glob("*after_codegen.txt"):
    for line in path.read_text().splitlines():
      if (call := _TPU_CALL.search(line)) and (scoped := _SCOPED.search(line)):
        # XLA suffixes the kernel's name: `.3`, or on jax 0.12 `.1.ds_ref` (a value's name)
        name = call.group(1).split(".")[0]
        size = sum(int(s) for s in _SIZE.findall(scoped.group(1)))
        out[name] = max(out.get(name, 0), size)
  return out


def mosaic_gpu(dump: pathlib.Path) -> dict:
  """{entry function: {registers, spills, ..., smem}} for every Mosaic GPU kernel in a
  MOSAIC_GPU_DUMP_TO directory holding one program's kernels. Files are numbered per dump
  (lowering and compile count separately), so a kernel's files pair by its name."""
  smem = {}
  for path in dump.glob("*.resources.txt"):
    if m := _MOSAIC_SMEM.search(path.read_text()):
      smem[path.name.removesuffix(".resources.txt").rsplit("_", 1)[0]] = int(m.group(1))
  out = {}
  for path in sorted(dump.glob("*.ptxas")):
    out.update(ptxas(path.read_text()))
  for name, kernel in smem.items():  # a kernel compiled earlier in the process has no .ptxas
    out.setdefault(f"{name}_mosaic_gpu_kernel", {})["smem"] = kernel
  for name, sass in mosaic_gpu_sass(dump).items():  # with MOSAIC_GPU_DUMP_SASS set
    out.setdefault(name, {}).update(sass)
  return out


def requested_shared_memory(error: str) -> int | None:
  """The shared memory a failing GPU kernel asked for, from XLA's or Mosaic GPU's error."""
  m = _REQUESTED.search(error) or _MOSAIC_SMEM_ERROR.search(error)
  return int(m.group(1)) if m else None
