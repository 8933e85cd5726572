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
per SM and waves on the chip's SMs.

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

# The kernels of every op on Hopper, bf16, at the paper's shapes: a grad case compiles the
# forward kernel and the backward ones (Mosaic GPU compiles each once per process).
# The warp-specialized FlashFFN forward (not a default: measured on no chip yet) at the tuned
# tiles and with 64-wide table tiles.
CASES = ("flash_ffn/370m/grad/bfloat16",
         "flash_ffn/370m/grad/bfloat16@mosaic_gpu+compute_wgs=2",
         "flash_ffn/370m/grad/bfloat16@mosaic_gpu+block_inter=64,compute_wgs=2",
         "frac_scan/16k/grad/bfloat16", "pack3d/65k/grad/bfloat16")

# Hopper: 64K 32-bit registers, 228 KiB shared memory (1 KiB of it reserved per CTA),
# 2048 threads and 32 CTAs per SM; registers are allocated per warp in units of 256.
SM_REGISTERS, SM_SMEM, SM_THREADS, SM_CTAS, REG_UNIT, CTA_RESERVED = (
    65536, 228 * 1024, 2048, 32, 256, 1024)
SMS = {"gpu-h100": 132, "gpu-h200": 132}

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


def counts(body: list[Instruction]) -> dict:
  """What one pass over `body` issues (see the module docstring)."""
  hgmma, a_regs, flops = collections.Counter(), 0, 0
  mufu, depbar_levels = collections.Counter(), []
  c = collections.Counter()
  for i in body:
    op = i.op
    if m := _HGMMA.match(op):
      mm, n, k = (int(g) for g in m.groups())
      hgmma[f"{mm}x{n}x{k}"] += 1
      flops += 2 * mm * n * k
      # A from registers: a register operand before the descriptor (`R24, R152, gdesc[..]`)
      a_regs += bool(re.match(r"R\d+, R\d+,", i.args))
    elif op.startswith("WARPGROUP.DEPBAR"):
      c["depbar"] += 1
      level = re.search(r"0x([0-9a-f]+)", i.args)
      depbar_levels.append(int(level.group(1), 16) if level else 0)
    elif op.startswith("WARPGROUP.ARRIVE"):
      c["wg_arrive"] += 1
    elif op.startswith(("STS", "STSM")):
      c["smem_stores"] += 1
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
  return {"instructions": len(body), "hgmma": dict(sorted(hgmma.items())),
          "hgmma_a_from_registers": a_regs, "hgmma_flops": flops,
          "depbar_max_in_flight": max(depbar_levels, default=None),
          "mufu": dict(sorted(mufu.items())),
          **{k: c[k] for k in ("depbar", "wg_arrive", "smem_stores", "fences", "bar_syncs",
                               "mbarrier_ops", "tma", "fchk", "local_memory")}}


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


def dump_report(dump: pathlib.Path) -> dict:
  """{entry function: {"sass": summary, "grid", "threads"}} for a MOSAIC_GPU_DUMP_TO
  directory written with MOSAIC_GPU_DUMP_SASS set (empty when it was not)."""
  out = {}
  for path in sorted(dump.glob("*.sass_ctrl")) or sorted(dump.glob("*.sass")):
    for name, s in summary(path.read_text()).items():
      out[name] = {"sass": s}
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
                    spills=k["sass"]["local_memory"], **occ)
      for i, loop in enumerate(k["sass"]["loops"]):
        out.append(dict(kernel, loop=i, **loop))
  return out


def _mix(d: dict) -> str:
  return " + ".join(f"{n}x {k}" for k, n in d.items()) or "-"


def markdown(table: list[dict]) -> str:
  head = ("| kernel (loop) | HGMMA per iteration (A from regs) | DEPBAR (most in flight) | "
          "STS/STSM · fences · BAR | mbarrier · TMA | MUFU | FCHK · LDL/STL | instr. | "
          "regs · smem · threads · USETMAXREG | grid · CTAs/SM (limit) · waves |")
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
        f"({t['limited_by']}) · {t['waves']:.2f} |")
  return "\n".join(lines)


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
  os.environ["MOSAIC_GPU_DUMP_MLIR_PASSES"] = "1"  # the launch's grid and threads
  results = run_target(target, [cases_lib.parse(c) for c in args.cases.split(";")],
                       args.timeout)
  failed = [r["case"] for r in results if r["status"] != "ok"]
  table = rows(results, SMS[args.target])
  text = markdown(table)
  note = (f"{args.target} (sm_90a), {len(results)} cases, "
          f"{len(table)} rows{'; failed: ' + ', '.join(failed) if failed else ''}")
  print(text + "\n" + note)
  pathlib.Path(args.out + ".json").write_text(json.dumps(table, indent=1) + "\n")
  pathlib.Path(args.out + ".md").write_text(text + "\n\n" + note + "\n")
  if args.readme:
    replace_section(README, BEGIN, END, text + "\n\n" + note)
  return 1 if failed or not table else 0


if __name__ == "__main__":
  sys.exit(main())
