"""What the Mosaic GPU kernels compile to on Hopper, read from their SASS without a GPU.

  make sass                                     # every Mosaic GPU kernel, H100, bf16
  python -m benchmarks.aot.sass --readme        # the same, run by hand after `make sass-setup`
  python -m benchmarks.aot.sass --cases="flash_ffn/370m/grad/bfloat16"

Each case compiles deviceless in the GPU venv (as the compile check does) with Mosaic GPU's
SASS dump on (`MOSAIC_GPU_DUMP_SASS`, which runs `nvdisasm` from the CUDA root beside the
venv's ptxas: `cuda_root()` builds one). For each kernel the table counts, over the body of
its main loop (the innermost loop holding tensor-core instructions), what decides whether
the tensor cores stay busy: HGMMA instructions by shape and whether A comes from registers,
`WARPGROUP.DEPBAR` waits (and the most WGMMA groups each leaves in flight), shared-memory
stores (`STS`, `STSM`) and async-proxy fences, named-barrier syncs, mbarrier operations, TMA
copies, MUFU (special-function unit) operations by function, `FCHK` (IEEE division's range
check), local-memory spills (`LDL`/`STL`) and instructions; and per kernel `USETMAXREG`
(register reallocation between warpgroups), registers, shared memory, threads, grid, CTAs
per SM and waves on the chip's SMs. From these counts, per loop, a static bound (`bound`):
the share of one warpgroup's iteration the tensor cores can be busy, given shared-memory
bandwidth, instruction issue and the MUFU's rate; and the TFLOP/s it predicts at the chip's
clock over the grid's waves. Per kernel also ptxas's advisories (`C75xx` codes, read from the
`.ptxas` files Mosaic GPU writes with `MOSAIC_GPU_DUMP_PTXAS`; they are not in the SASS).

These are static counts of the loop body as compiled (every instruction once per iteration;
predicated-off and retried instructions count once): evidence of what each change of the
kernel did to the code, not a timing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import pathlib
import re
import sys

from tools.readme_section import replace_section

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).parent
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- sass:begin -->", "<!-- sass:end -->"

# The Mosaic GPU kernels of every op on Hopper, bf16, at the paper's shapes: a grad case
# compiles the forward kernel and the backward ones (Mosaic GPU compiles each once per
# process). The bodies measured on no chip yet are asked for by name (`@mosaic_gpu`), as the
# default would give Triton there: the warp-specialized FlashFFN bodies at the tuned tiles and
# with 64-wide table tiles, FRAC's and Pack3D's.
CASES = ("flash_ffn/370m/grad/bfloat16",
         "flash_ffn/370m/grad/bfloat16@mosaic_gpu+compute_wgs=2",
         "flash_ffn/370m/grad/bfloat16@mosaic_gpu+block_inter=64,compute_wgs=2",
         "frac_scan/16k/grad/bfloat16@mosaic_gpu", "pack3d/65k/grad/bfloat16@mosaic_gpu")

# Hopper: 64K 32-bit registers, 228 KiB shared memory (1 KiB of it reserved per CTA),
# 2048 threads and 32 CTAs per SM; registers are allocated per warp in units of 256.
SM_REGISTERS, SM_SMEM, SM_THREADS, SM_CTAS, REG_UNIT, CTA_RESERVED = (
    65536, 228 * 1024, 2048, 32, 256, 1024)
SMS = {"gpu-h100": 132, "gpu-h200": 132}

# The static bound's rates, per SM and clock on Hopper (sm_90). A warpgroup is 4 warps, one on
# each of the SM's 4 sub-partitions; every quantity below is one warpgroup's iteration in SM
# cycles, so warpgroups sharing an SM scale all of them alike and the ratio holds for any
# number of them.
# - Tensor cores: dense FMA per cycle per SM by input type; bf16/f16 2048 (H100 whitepaper:
#   989.4 dense bf16 TFLOP/s = 132 SMs x 1.83 GHz x 2048 x 2; issue 47: 64x128x16 = 64 cycles).
TC_FMA_PER_CYCLE = {"BF16": 2048, "F16": 2048, "TF32": 1024, "E4M3": 4096, "E5M2": 4096}
OPERAND_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1}
# - Shared memory: 32 banks x 4 B = 128 B per cycle per SM (CUDA programming guide, shared
#   memory; Hopper tuning guide). An HGMMA reads its B tile once per warpgroup (and A when
#   A is not in registers): a 64xNx16 bf16 HGMMA with both from shared memory moves
#   32 N + 2048 B in N / 2 cycles, more than 128 B per cycle for N < 64.
SMEM_BYTES_PER_CYCLE = 128
# - Issue: one warp instruction per cycle per sub-partition (Hopper whitepaper: one warp
#   scheduler per SM sub-partition), so a warpgroup issues its loop in `instructions` cycles.
ISSUE_PER_CYCLE_PER_SUBPARTITION = 1
# - MUFU: 16 results per cycle per SM for exp2/rcp/rsqrt/log2/sin/cos (CUDA programming guide,
#   arithmetic instruction throughput, compute capability 9.0; tanh taken as the same unit):
#   one warpgroup's MUFU instruction is 4 x 32 results, 8 cycles.
MUFU_PER_CYCLE = 16
WARPS_PER_WARPGROUP, WARP = 4, 32
# - The clock the prediction uses: H100 SXM's max boost, 1.98 GHz (NVIDIA's H100 datasheet;
#   the whitepaper's 989.4 TFLOP/s is at 1.83 GHz), 132 SMs: 1070 dense bf16 TFLOP/s.
CLOCK_HZ = 1.98e9
# The only chip figures so far (one H200, 2026-12-04, bf16, 370M shape): the one-warpgroup
# FlashFFN forward and its fwd+bwd (counted as 3x the forward's FLOPs), in TFLOP/s.
MEASURED = {"flash_ffn_fwd": 365.0, "flash_ffn fwd+bwd": 182.0}

_LINE = re.compile(r"^\s*(?P<ctrl>[-\d&]+:[-\d]:[-\d]:[-Y]:\d+)?\s*/\*(?P<addr>[0-9a-f]{4,})\*/"
                   r"\s+(?P<pred>@!?U?P[T\d]+\s+)?(?P<op>[A-Z][\w.]*)(?P<args>.*?)\s*;?\s*$")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"\((\.L_x_\d+)\)")
_FUNCTION = re.compile(r"^\.text\.(\S+):")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Instruction:
  addr: int
  op: str            # opcode with its modifiers, e.g. "HGMMA.64x128x16.F32.BF16"
  args: str
  predicated: bool
  stall: int         # the control code's stall cycles (0 when absent)


def parse(text: str) -> dict[str, tuple[list[Instruction], dict[str, int]]]:
  """{function: (instructions, {label: address})} from nvdisasm output (with or without
  control codes, `-print-instruction-encoding` off)."""
  functions, name, labels, pending = {}, None, {}, []
  for line in text.splitlines():
    if m := _FUNCTION.match(line.strip()):
      name, labels, pending = m.group(1), {}, []
      functions[name] = ([], labels)
    elif name is None:
      continue
    elif m := _LABEL.match(line.strip()):
      pending.append(m.group(1))
    elif m := _LINE.match(line):
      addr = int(m.group("addr"), 16)
      for label in pending:
        labels[label] = addr
      pending = []
      ctrl = m.group("ctrl")
      functions[name][0].append(Instruction(
          addr, m.group("op"), m.group("args").strip(), bool(m.group("pred")),
          int(ctrl.rsplit(":", 1)[1]) if ctrl else 0))
  return functions


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
  """(first, last) addresses of each loop: a branch back to an earlier label, placed before
  the last EXIT (the mbarrier-wait retry stubs after it branch back into loop bodies: not
  loops of the kernel's own)."""
  exits = [i.addr for i in instructions if i.op == "EXIT"]
  end = exits[-1] if exits else math.inf
  out = []
  for i in instructions:
    if i.op.startswith("BRA") and i.addr < end and (t := _TARGET.search(i.args)):
      if (start := labels.get(t.group(1))) is not None and start <= i.addr:
        out.append((start, i.addr))
  return out


def main_loops(instructions, labels) -> list[tuple[int, int]]:
  """The innermost loops holding HGMMA instructions, in address order."""
  with_mma = [(a, b) for a, b in loops(instructions, labels)
              if any(a <= i.addr <= b and i.op.startswith("HGMMA") for i in instructions)]
  inner = [(a, b) for a, b in with_mma
           if not any((c, d) != (a, b) and a <= c and d <= b for c, d in with_mma)]
  return sorted(set(inner))


def smem_bytes(op: str) -> int:
  """Bytes one warp's shared-memory load or store moves (0 for any other instruction):
  `LDS`/`STS` 4 B a thread unless sized (`.U8`, `.U16`, `.64`, `.128`, ...), `LDSM`/`STSM`
  128 B per 8x8 16-bit matrix (`.M88.4`: four). Predicated-off lanes count as moving."""
  parts = op.split(".")
  if parts[0] in ("LDSM", "STSM"):
    return 128 * (int(parts[-1]) if parts[-1] in ("1", "2", "4") else 1)
  if parts[0] in ("LDS", "STS"):
    sizes = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
    return WARP * next((sizes[p] for p in parts[1:] if p in sizes), 4)
  return 0


def bound(c: dict) -> dict:
  """The static bound of one warpgroup's iteration from its counts `c` (see the constants'
  comments): cycles the tensor cores, shared memory, instruction issue and the MUFU need,
  and `bound` = tensor cycles / the largest of them. An upper bound: it ignores latency,
  dependencies, bank conflicts and the TMA's writes into shared memory (a copy's size is
  in its tensor map, not in the SASS)."""
  cycles = {"tensor": c["tensor_cycles"],
            "smem": (c["hgmma_smem_bytes"] + WARPS_PER_WARPGROUP * c["lds_sts_bytes"])
            / SMEM_BYTES_PER_CYCLE,
            "issue": c["instructions"] / ISSUE_PER_CYCLE_PER_SUBPARTITION,
            "mufu": sum(c["mufu"].values()) * WARPS_PER_WARPGROUP * WARP / MUFU_PER_CYCLE}
  limit = max(cycles, key=cycles.get)
  return {"cycles": cycles, "cycles_limit": limit,
          "bound": cycles["tensor"] / cycles[limit] if cycles[limit] else 0.0}


def counts(body: list[Instruction]) -> dict:
  """What one pass over `body` issues (see the module docstring)."""
  hgmma, a_regs, flops = collections.Counter(), 0, 0
  mufu, depbar_levels = collections.Counter(), []
  tensor_cycles, hgmma_smem, lds_sts = 0.0, 0, 0
  c = collections.Counter()
  for i in body:
    op = i.op
    if m := _HGMMA.match(op):
      mm, n, k = (int(g) for g in m.groups())
      hgmma[f"{mm}x{n}x{k}"] += 1
      flops += 2 * mm * n * k
      kind = op.split(".")[-1]  # the inputs' type: HGMMA.64x128x16.F32.BF16
      tensor_cycles += mm * n * k / TC_FMA_PER_CYCLE.get(kind, 2048)
      # A from registers: a register operand before the descriptor (`R24, R152, gdesc[..]`)
      a_reg = bool(re.match(r"R\d+, R\d+,", i.args))
      a_regs += a_reg
      hgmma_smem += (n * k + (0 if a_reg else mm * k)) * OPERAND_BYTES.get(kind, 2)
    elif op.startswith("WARPGROUP.DEPBAR"):
      c["depbar"] += 1
      level = re.search(r"0x([0-9a-f]+)", i.args)
      depbar_levels.append(int(level.group(1), 16) if level else 0)
    elif op.startswith("WARPGROUP.ARRIVE"):
      c["wg_arrive"] += 1
    elif op.startswith(("STS", "STSM")):
      c["smem_stores"] += 1
      lds_sts += smem_bytes(op)
    elif op.startswith(("LDS", "LDSM")):
      lds_sts += smem_bytes(op)
    elif op.startswith(("FENCE.VIEW.ASYNC", "MEMBAR")):
      c["fences"] += 1
    elif op.startswith("BAR."):
      c["bar_syncs"] += 1
    elif op.startswith("SYNCS"):
      c["mbarrier_ops"] += 1
    elif op.startswith(("UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP", "UBLKRED")):
      c["tma"] += 1
    elif op.startswith("MUFU."):
      mufu[op.split(".")[1]] += 1
    elif op.startswith("FCHK"):
      c["fchk"] += 1
    elif op.startswith(("LDL", "STL")):
      c["local_memory"] += 1
  out = {"instructions": len(body), "hgmma": dict(sorted(hgmma.items())),
         "hgmma_a_from_registers": a_regs, "hgmma_flops": flops,
         "tensor_cycles": tensor_cycles, "hgmma_smem_bytes": hgmma_smem,
         "lds_sts_bytes": lds_sts,
         "depbar_max_in_flight": max(depbar_levels, default=None),
         "mufu": dict(sorted(mufu.items())),
         **{k: c[k] for k in ("depbar", "wg_arrive", "smem_stores", "fences", "bar_syncs",
                              "mbarrier_ops", "tma", "fchk", "local_memory")}}
  return dict(out, **bound(out))


def summary(text: str) -> dict:
  """{function: {"loops": [counts of each main loop], "usetmaxreg": [...], "spills": n}}."""
  out = {}
  for name, (instructions, labels) in parse(text).items():
    body = lambda a, b: [i for i in instructions if a <= i.addr <= b]
    out[name] = {
        # a kernel without a loop around its HGMMAs (one tile per CTA): the whole kernel
        "loops": ([counts(body(a, b)) for a, b in main_loops(instructions, labels)]
                  or [dict(counts(instructions), whole_kernel=True)]),
        "usetmaxreg": [i.args.split(",")[-1].strip() for i in instructions
                       if i.op.startswith("USETMAXREG")],
        "local_memory": sum(i.op.startswith(("LDL", "STL")) for i in instructions),
        "instructions": len(instructions)}
  return out


_LAUNCH = re.compile(r"(blocks|threads)\([^)]*\) in \(([^)]*)\)")
_INDEX = re.compile(r"(%[\w.]+) = arith\.constant (\d+) : index")


def launch(lines) -> dict:
  """{"grid": [x, y, z], "threads": [x, y, z]} of the first gpu.launch in a Mosaic GPU
  module's text (an iterable of lines, read only up to that launch), its sizes resolved
  through the module's index constants."""
  constants = {}
  for line in lines:
    for name, value in _INDEX.findall(line):
      constants[name] = int(value)
    if "gpu.launch" in line and (found := _LAUNCH.findall(line)):
      return {{"blocks": "grid"}.get(kind, kind):
              [constants.get(v.split("=")[1].strip(), 0) for v in dims.split(",")]
              for kind, dims in found}
  return {}


def occupancy(registers: int, threads: int, smem: int, grid: int, sms: int) -> dict:
  """CTAs per SM (the tightest of registers, shared memory, threads and the CTA limit) and
  waves: grid / (SMs x CTAs per SM)."""
  warps = math.ceil(threads / 32)
  per_warp = math.ceil(registers * 32 / REG_UNIT) * REG_UNIT
  limits = {"registers": SM_REGISTERS // (per_warp * warps) if registers else SM_CTAS,
            "smem": SM_SMEM // (smem + CTA_RESERVED),
            "threads": SM_THREADS // threads, "ctas": SM_CTAS}
  per_sm = min(limits.values())
  return {"ctas_per_sm": per_sm, "limited_by": min(limits, key=limits.get),
          "waves": grid / (sms * per_sm) if per_sm else math.inf}


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_ADVISORY = re.compile(r"\((C75\d\d)\)")
_IN_FUNCTION = re.compile(r"in (?:the )?function '([^']+)'")


def advisories(text: str) -> dict[str, list[str]]:
  """{function: sorted C75xx codes} from ptxas's output: its performance advisories, e.g.
  `ptxas info : (C7517) warpgroup.wait is injected in around line 594 by compiler to allow
  use of registers defined by GMMA in function 'k'` (printed before `Compiling entry
  function 'k'`). One naming no function belongs to the entry function compiled next, or
  the last one when none follows."""
  out, pending, current = {}, set(), None
  for line in text.splitlines():
    if m := _ENTRY.search(line):
      current = m.group(1)
      out.setdefault(current, set()).update(pending)
      pending = set()
    for code in _ADVISORY.findall(line):
      if m := _IN_FUNCTION.search(line):
        out.setdefault(m.group(1), set()).add(code)
      else:
        pending.add(code)
  if pending and current is not None:
    out[current].update(pending)
  return {name: sorted(codes) for name, codes in out.items() if codes}


def dump_report(dump: pathlib.Path) -> dict:
  """{entry function: {"sass": summary, "advisories", "grid", "threads"}} for a
  MOSAIC_GPU_DUMP_TO directory written with MOSAIC_GPU_DUMP_SASS set (empty when it was
  not); "advisories" from the `.ptxas` files (MOSAIC_GPU_DUMP_PTXAS)."""
  out = {}
  for path in sorted(dump.glob("*.sass_ctrl")) or sorted(dump.glob("*.sass")):
    for name, s in summary(path.read_text()).items():
      out[name] = {"sass": s, "advisories": []}
  for path in sorted(dump.glob("*.ptxas")):
    for name, codes in advisories(path.read_text()).items():
      if name in out:
        out[name]["advisories"] = sorted(set(out[name]["advisories"]) | set(codes))
  for name in out:  # the module as lowered: MOSAIC_GPU_DUMP_MLIR_PASSES' log
    kernel = name.removesuffix("_mosaic_gpu_kernel")
    for path in dump.glob(f"{kernel}_[0-9]*.mlir-passes.log"):
      with path.open() as f:
        out[name].update(launch(f))
  return out


def cuda_root(venv: pathlib.Path) -> pathlib.Path:
  """A CUDA root holding the venv's ptxas and libdevice and the nvdisasm that `make
  sass-setup` put in `<venv>/nvdisasm` (jax's own lookup prefers an `nvidia.cu13` package,
  which has no ptxas: so nvdisasm is kept off the venv's path)."""
  site = next((venv / "lib").glob("python3*/site-packages"))
  nvcc, disasm = site / "nvidia" / "cuda_nvcc", venv / "nvdisasm" / "nvidia" / "cu13" / "bin"
  if not (disasm / "nvdisasm").exists():
    sys.exit(f"sass: {disasm}/nvdisasm is missing; run `make sass-setup`")
  root = venv / "cuda-root"
  (root / "bin").mkdir(parents=True, exist_ok=True)
  for link, target in ((root / "bin" / "ptxas", nvcc / "bin" / "ptxas"),
                       (root / "bin" / "nvdisasm", disasm / "nvdisasm"),
                       (root / "nvvm", nvcc / "nvvm")):
    if not link.is_symlink():
      link.symlink_to(target)
  return root


def rows(results: list[dict], sms: int) -> list[dict]:
  """One row per (case, kernel, main loop) with the kernel's launch and occupancy."""
  out = []
  for r in results:
    for name, k in r.get("kernels", {}).items():
      if "sass" not in k:
        continue
      threads, grid = math.prod(k.get("threads", [128])), math.prod(k.get("grid", [0]))
      occ = occupancy(k.get("registers", 0), threads, k.get("smem", 0), grid, sms)
      blocks = r["case"].partition("+")[2]  # a case's block overrides name its variant
      kernel = dict(case=r["case"], kernel=name.removesuffix("_mosaic_gpu_kernel")
                    + (f" ({blocks})" if blocks else ""),
                    registers=k.get("registers"), smem=k.get("smem"), threads=threads,
                    grid=grid, usetmaxreg=k["sass"]["usetmaxreg"],
                    spills=k["sass"]["local_memory"], advisories=k.get("advisories"), **occ)
      for i, loop in enumerate(k["sass"]["loops"]):
        out.append(dict(kernel, loop=i, **loop,
                        predicted_tflops=predicted_tflops(loop, occ["waves"], sms)))
  return out


def tail(waves: float) -> float:
  """The share of the last wave's time the grid keeps the SMs busy over all its waves:
  waves / waves rounded up (5.17 waves take 6 waves' time). Counting the last wave's work as
  none (full waves / waves rounded up) would predict 0 for a grid of less than one wave."""
  return waves / math.ceil(waves) if 0 < waves < math.inf else 0.0


def predicted_tflops(loop: dict, waves: float, sms: int) -> float:
  """The TFLOP/s of HGMMA work (recomputation included) the bound allows at CLOCK_HZ on
  `sms` SMs: the loop's FLOPs per cycle of its limiting resource, times the waves' tail."""
  slowest = loop["cycles"][loop["cycles_limit"]]
  if not slowest:
    return 0.0
  return loop["hgmma_flops"] / slowest * sms * CLOCK_HZ * tail(waves) / 1e12


def _mix(d: dict) -> str:
  return " + ".join(f"{n}x {k}" for k, n in d.items()) or "-"


def markdown(table: list[dict]) -> str:
  head = ("| kernel (loop) | HGMMA per iteration (A from regs) | DEPBAR (most in flight) | "
          "STS/STSM · fences · BAR | mbarrier · TMA | MUFU | FCHK · LDL/STL | instr. | "
          "regs · smem · threads · USETMAXREG | grid · CTAs/SM (limit) · waves | "
          "cycles/iter.: tensor · smem (no TMA) · issue · MUFU | bound (limit) · TFLOP/s | "
          "ptxas advisories |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for t in table:
    loop = " (whole kernel)" if t.get("whole_kernel") else f" ({t['loop']})" if t["loop"] else ""
    mma = _mix(t.get("hgmma", {}))
    lines.append(
        f"| {t['kernel']}{loop} | {mma} ({t.get('hgmma_a_from_registers', 0)}) | "
        f"{t.get('depbar', 0)} ({t.get('depbar_max_in_flight')}) | "
        f"{t.get('smem_stores', 0)} · {t.get('fences', 0)} · {t.get('bar_syncs', 0)} | "
        f"{t.get('mbarrier_ops', 0)} · {t.get('tma', 0)} | {_mix(t.get('mufu', {}))} | "
        f"{t.get('fchk', 0)} · {t['spills']} | {t.get('instructions', 0)} | "
        f"{t['registers']} · {(t['smem'] or 0) // 1024}K · {t['threads']} · "
        f"{','.join(t['usetmaxreg']) or '-'} | {t['grid']} · {t['ctas_per_sm']} "
        f"({t['limited_by']}) · {t['waves']:.2f} | {_bound_cells(t)} |")
  return "\n".join(lines)


def _bound_cells(t: dict) -> str:
  if "cycles" not in t:  # a results file from before the bound
    return "n/a | n/a | n/a"
  c = t["cycles"]
  cycles = " · ".join(f"{c[k]:.0f}" for k in ("tensor", "smem", "issue", "mufu"))
  # a kernel whose .ptxas was not read (None) is not one without advisories ([])
  codes = "n/a" if t.get("advisories") is None else ", ".join(t["advisories"]) or "none"
  return (f"{cycles} | {t['bound']:.0%} ({t['cycles_limit']}) · "
          f"{t['predicted_tflops']:.0f} | {codes}")


def calibration(table: list[dict]) -> str:
  """How far the predictions are from the chip figures in MEASURED, for the kernels of the
  table that were measured."""
  fwd = [t for t in table if t["kernel"] == "flash_ffn_fwd"]
  if not fwd:
    return "No measured kernel in this table."
  p, m = fwd[0]["predicted_tflops"], MEASURED["flash_ffn_fwd"]
  back = [t for t in table if t["kernel"].startswith("flash_ffn_bwd") and " (" not in t["kernel"]]
  slowest = min((t["predicted_tflops"] for t in back), default=None)
  text = (f"Against the chip (one H200, 2026-12-04): flash_ffn_fwd is predicted {p:.0f} TFLOP/s "
          f"and measured {m:.0f} ({p / m:.2f}x the measurement)")
  if slowest is not None:
    text += (f"; fwd+bwd measured {MEASURED['flash_ffn fwd+bwd']:.0f} (3x forward FLOPs), "
             f"its backward kernels predicted {slowest:.0f} TFLOP/s at the slowest loop "
             f"(a fwd+bwd prediction needs each kernel's FLOPs per call, not in the SASS)")
  return text + ". Not yet calibrated: the bound is an upper bound (no latency)."


def main(argv=None):
  from benchmarks.aot import cases as cases_lib
  from benchmarks.aot.check import run_target
  from benchmarks.aot.targets import TARGETS

  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target", default="gpu-h100", choices=sorted(SMS))
  parser.add_argument("--cases", default=";".join(CASES), help="case names separated by ;")
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
  parser.add_argument("--out", default=str(HERE / "sass"), help="results .json/.md prefix")
  parser.add_argument("--readme", action="store_true", help="rewrite benchmarks/README.md's table")
  args = parser.parse_args(argv)
  target = TARGETS[args.target]
  os.environ["CUDA_ROOT"] = str(cuda_root(ROOT / target.venv))
  os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # ptxas's advisories (C75xx) in `.ptxas` files
  os.environ["MOSAIC_GPU_DUMP_MLIR_PASSES"] = "1"  # the launch's grid and threads
  results = run_target(target, [cases_lib.parse(c) for c in args.cases.split(";")],
                       args.timeout)
  failed = [r["case"] for r in results if r["status"] != "ok"]
  table = rows(results, SMS[args.target])
  text = markdown(table)
  note = (f"{args.target} (sm_90a), {len(results)} cases, "
          f"{len(table)} rows{'; failed: ' + ', '.join(failed) if failed else ''}. "
          + calibration(table))
  print(text + "\n" + note)
  pathlib.Path(args.out + ".json").write_text(json.dumps(table, indent=1) + "\n")
  pathlib.Path(args.out + ".md").write_text(text + "\n\n" + note + "\n")
  if args.readme:
    replace_section(README, BEGIN, END, text + "\n\n" + note)
  return 1 if failed or not table else 0


if __name__ == "__main__":
  sys.exit(main())
