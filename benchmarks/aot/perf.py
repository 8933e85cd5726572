"""TPU performance without a TPU: libtpu's static cycle estimate of every op's kernel beside
the XLA program it replaces (`make perf-tpu`; not in CI: each compile takes 10 s to minutes).

  python -m benchmarks.aot.perf                         # the table, v5e and v6e, bf16 and f32
  python -m benchmarks.aot.perf --readme                # also into benchmarks/README.md
  python -m benchmarks.aot.perf --targets=tpu-v5e --programs=flash_ffn/kernel,flash_ffn/swiglu
  python -m benchmarks.aot.perf --sweep                 # FlashFFN block sizes per chip and dtype

Each program compiles in its own process (`perf_worker`, inside .venv-aot-tpu) with a memory
watchdog. A row: the estimated cycles, microseconds at the chip's clock, the share of the MXU
peak its model FLOPs would take in that time, the HBM floor (the bytes it must move at the
chip's bandwidth: the estimate is optimistic for memory-bound code, so the row reads the
larger of the two) and the ratio of that reading to the group's baseline. The estimate is a
static schedule, not a timing, and has not been checked against a real TPU.

The sweep compiles the forward and the backward Mosaic kernels alone over a grid of block
sizes and writes benchmarks/aot/perf_sweep.json; `pallas_kernels/flash_ffn/blocks.py` TUNED
holds its best entries (tests/test_perf_tpu.py checks that they agree).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.aot import perf_programs
from tools.readme_section import replace_section

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).parent
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- perf-tpu:begin -->", "<!-- perf-tpu:end -->"
RESULTS = HERE / "perf.json"
SWEEP = HERE / "perf_sweep.json"


@dataclasses.dataclass(frozen=True)
class Chip:
  clock_hz: float
  flops_per_cycle: int     # bf16 MXU peak
  hbm_bytes_per_s: float


# jax's `tpu_info` (bf16 peak, HBM bandwidth); the clock is the peak over the MXUs' MACs per
# cycle (v5e: 4 MXUs of 128 x 128; v6e: 4 of 256 x 256, which the estimate bears out: XLA's
# bf16 matmuls reach 90%+ of it).
CHIPS = {"tpu-v5e": Chip(1.97e14 / (4 * 128 * 128 * 2), 4 * 128 * 128 * 2, 8.2e11),
         "tpu-v6e": Chip(9.2e14 / (4 * 256 * 256 * 2), 4 * 256 * 256 * 2, 1.64e12)}

# Rows of the table: (program, its group's baseline program).
TABLE = [
    ("flash_ffn/kernel", "flash_ffn/swiglu"), ("flash_ffn/kernels", "flash_ffn/swiglu"),
    ("flash_ffn/routed_kernels", "flash_ffn/swiglu"),
    ("flash_ffn/wide_kernels", "flash_ffn/swiglu"),
    ("flash_ffn/lm370frac_routed_kernels", "flash_ffn/swiglu"),
    ("flash_ffn/xla", "flash_ffn/swiglu"),
    ("flash_ffn/swiglu", "flash_ffn/swiglu"),
    ("frac/kernel", "frac/xla"), ("frac/xla", "frac/xla"),
    ("pack3d/kernel", "pack3d/xla"), ("pack3d/kernels", "pack3d/dense"),
    ("pack3d/xla", "pack3d/xla"),
    ("pack3d/dense", "pack3d/dense"),
    ("layer/flash_ffn", "layer/swiglu"), ("layer/swiglu", "layer/swiglu"),
]
# Rows read as the sum of separate compiles: FlashFFN's two kernels in one profiled program
# ask for 127 MiB of "HLO temp" VMEM that no real compile asks for (the compile check's
# fwd+bwd cases pass), so each kernel is profiled on its own.
PARTS = {("flash_ffn/kernels", "fwd"): ("flash_ffn/fwd_kernel",),
         ("flash_ffn/kernels", "fwd+bwd"): ("flash_ffn/fwd_kernel", "flash_ffn/bwd_kernel"),
         ("flash_ffn/routed_kernels", "fwd"): ("flash_ffn/routed_fwd_kernel",),
         ("flash_ffn/routed_kernels", "fwd+bwd"): ("flash_ffn/routed_fwd_kernel",
                                                   "flash_ffn/routed_bwd_kernel"),
         ("flash_ffn/lm370frac_routed_kernels", "fwd"): ("flash_ffn/lm370frac_routed_fwd_kernel",),
         ("flash_ffn/lm370frac_routed_kernels", "fwd+bwd"): (
             "flash_ffn/lm370frac_routed_fwd_kernel", "flash_ffn/lm370frac_routed_bwd_kernel"),
         ("flash_ffn/wide_kernels", "fwd"): ("flash_ffn/wide_fwd_kernel",),
         ("flash_ffn/wide_kernels", "fwd+bwd"): ("flash_ffn/wide_fwd_kernel",
                                                 "flash_ffn/wide_bwd_kernel")}


def run_row(target, program, direction, dtype, timeout, max_rss_gb) -> dict:
  """One table row: a compile, or the sum of its PARTS' compiles (each with direction fwd)."""
  parts = PARTS.get((program, direction))
  if parts is None:
    return run_worker(target, program, direction, dtype, {}, timeout, max_rss_gb)
  results = [run_worker(target, p, "fwd", dtype, {}, timeout, max_rss_gb) for p in parts]
  row = dict(results[0], program=program, direction=direction,
             peak_rss_gb=max(r.get("peak_rss_gb", 0) for r in results))
  failed = [r for r in results if r["status"] != "ok"]
  if failed:
    return dict(row, status=failed[0]["status"], error=failed[0]["error"])
  for field in ("flops", "hbm_bytes", "cycles", "kernel_cycles"):
    row[field] = sum(r[field] for r in results)
  row["compile_s"] = round(sum(r["compile_s"] for r in results), 1)
  row["top_ops"] = {op: c for r in results for op, c in r["top_ops"].items()}
  return row


# FlashFFN sweep: token tiles of the forward and the backward kernels, and d_e tiles.
SWEEP_GRID = {"block_q": (256, 512, 1024, 2048), "block_q_dkv": (128, 256, 512, 1024),
              "block_inter": (128, 256)}


def run_worker(target: str, program: str, direction: str, dtype: str, blocks: dict,
               timeout: float, max_rss_gb: float) -> dict:
  """One compile in .venv-aot-tpu; killed past `timeout` seconds or `max_rss_gb` of memory."""
  python = ROOT / ".venv-aot-tpu" / "bin" / "python"
  if not python.exists():
    sys.exit(f"perf: {python} is missing; run `make aot-setup` (it creates .venv-aot-tpu)")
  base = dict(target=target, program=program, direction=direction, dtype=dtype, blocks=blocks)
  stderr = tempfile.TemporaryFile("w+")
  proc = subprocess.Popen(
      [str(python), "-m", "benchmarks.aot.perf_worker", f"--target={target}",
       f"--program={program}", f"--direction={direction}", f"--dtype={dtype}",
       f"--blocks={json.dumps(blocks)}"],
      cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
      stderr=stderr, text=True, start_new_session=True)
  start, peak = time.monotonic(), 0.0
  while proc.poll() is None:
    peak = max(peak, _rss_gb(proc.pid))
    if peak > max_rss_gb or time.monotonic() - start > timeout:
      os.killpg(proc.pid, 9)
      proc.wait()
      why = f"over {max_rss_gb:g} GB of memory" if peak > max_rss_gb else f"over {timeout:g} s"
      return dict(base, status="killed", error=f"the profiled compile ran {why}")
    time.sleep(0.5)
  lines = [l for l in proc.stdout.read().splitlines() if l.startswith("RESULT ")]
  if not lines:
    stderr.seek(0)
    return dict(base, status="crashed",
                error=f"exit status {proc.returncode}: {abort_reason(stderr.read())}")
  result = json.loads(lines[-1][len("RESULT "):])
  result["peak_rss_gb"] = round(peak, 1)
  return result


def abort_reason(log: str) -> str:
  """The message of libtpu's first fatal check (`F<date> ... file.cc:line] message`)."""
  fatal = re.search(r"^F\d{4} [^\]]*\] (.*)$", log, re.MULTILINE)
  return fatal.group(1).strip() if fatal else "libtpu aborted"


def _rss_gb(pid: int) -> float:
  try:
    pages = int(pathlib.Path(f"/proc/{pid}/statm").read_text().split()[1])
  except (OSError, IndexError, ValueError):
    return 0.0
  return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def reading(result: dict) -> dict:
  """Microseconds (estimate, HBM floor, the larger) and the share of the MXU peak."""
  chip = CHIPS[result["target"]]
  estimate = result["cycles"] / chip.clock_hz * 1e6
  floor = result["hbm_bytes"] / chip.hbm_bytes_per_s * 1e6
  mfu = result["flops"] / (result["cycles"] * chip.flops_per_cycle)
  return dict(us=estimate, floor_us=floor, read_us=max(estimate, floor), mfu=mfu)


def table(results: list[dict]) -> str:
  key = lambda r: (r["target"], r["program"], r["direction"], r["dtype"])
  by_key = {key(r): r for r in results}
  lines = ["| chip | dtype | direction | program | cycles (kernel) | us | % MXU peak | HBM floor us "
           "| vs baseline |", "|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    if r["program"] not in dict(TABLE):
      continue
    what = perf_programs.PROGRAMS[r["program"]][1]
    head = f"| {r['target']} | {r['dtype']} | {r['direction']} | {what} |"
    if r["status"] != "ok":
      lines.append(f"{head} {r['status']}: {_short(r['error'])} | | | | |")
      continue
    read = reading(r)
    base = by_key.get((r["target"], dict(TABLE)[r["program"]], r["direction"], r["dtype"]))
    ratio = (f"{read['read_us'] / reading(base)['read_us']:.2f}x"
             if base and base["status"] == "ok" else "-")
    kernel = f" ({r['kernel_cycles']:,})" if r.get("kernel_cycles") else ""
    lines.append(f"{head} {r['cycles']:,}{kernel} | {read['us']:,.0f} | {100 * read['mfu']:.0f}% "
                 f"| {read['floor_us']:,.0f} | {ratio} |")
  return "\n".join(lines)


def _short(error: str) -> str:
  """An error's first sentence that says something, for a table cell."""
  error = re.sub(r"^(JaxRuntimeError: )?RESOURCE_EXHAUSTED: XLA:TPU compile permanent error\. ",
                 "", error.splitlines()[0] if error else "")
  return error[:110].replace("|", "/")


def _merge(path: pathlib.Path, results: list[dict], key: str | None = None) -> list[dict]:
  """Earlier results in `path` (under `key` of its JSON object, if given) with these
  replacing the ones of the same program, direction, dtype, blocks and target."""
  identity = lambda r: (r["target"], r["program"], r["direction"], r["dtype"],
                        json.dumps(r.get("blocks", {}), sort_keys=True))
  old = json.loads(path.read_text()) if path.exists() else []
  if key is not None:
    old = old[key] if old else []
  merged = {identity(r): r for r in old}
  merged.update({identity(r): r for r in results})
  return list(merged.values())


# Token tiles within this fraction of the best count as ties, won by the smaller tile (a
# sequence pads to a whole tile: a smaller one wastes less on short sequences).
TIE = 0.01


def choose(results: list[dict], target: str, dtype: str) -> dict | None:
  """The BlockSizes fields the sweep's results pick for one chip and dtype: per block_inter,
  the forward's and the backward's best token tiles (ties to the smaller, `TIE`); block_inter
  is shared by both kernels, so it is the one whose two bests sum smallest."""
  cycles = {(r["program"].split("/")[1], *r["blocks"].values()): r["kernel_cycles"]
            for r in results if r["target"] == target and r["dtype"] == dtype
            and r["status"] == "ok" and r["program"].endswith("_kernel")}
  options = []
  for inter in SWEEP_GRID["block_inter"]:
    best = {}
    for which in ("fwd_kernel", "bwd_kernel"):
      tiles = {t: c for (w, t, i), c in cycles.items() if w == which and i == inter}
      if not tiles:
        break
      fastest = min(tiles.values())
      tile = min(t for t, c in tiles.items() if c <= fastest * (1 + TIE))
      best[which] = (tiles[tile], tile)
    if len(best) == 2:
      options.append((best["fwd_kernel"][0] + best["bwd_kernel"][0],
                      dict(block_q=best["fwd_kernel"][1], block_q_dkv=best["bwd_kernel"][1],
                           block_inter=inter)))
  return min(options, key=lambda o: o[0])[1] if options else None


def sweep(targets, dtypes, timeout, max_rss_gb, log) -> dict:
  """Compiles the forward (block_q x block_inter) and backward (block_q_dkv x block_inter)
  kernels over SWEEP_GRID, writes SWEEP and returns {target: {dtype: chosen fields}}."""
  results = []
  for target, dtype in itertools.product(targets, dtypes):
    for which, token_field in (("fwd_kernel", "block_q"), ("bwd_kernel", "block_q_dkv")):
      for tokens, inter in itertools.product(SWEEP_GRID[token_field], SWEEP_GRID["block_inter"]):
        blocks = {token_field: tokens, "block_inter": inter}
        r = run_worker(target, f"flash_ffn/{which}", "fwd", dtype, blocks, timeout, max_rss_gb)
        results.append(r)
        log(f"{target} {dtype} {which} {blocks}: " + (
            f"{r['kernel_cycles']:,}" if r["status"] == "ok"
            else f"{r['status']} {r.get('error', '')[:80]}"))
  results = _merge(SWEEP, results, key="results")
  best = {t: {d: c for d in dtypes if (c := choose(results, t, d))} for t in targets}
  SWEEP.write_text(json.dumps({"best": best, "results": results}, indent=1) + "\n")
  return best


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--targets", default="tpu-v5e,tpu-v6e")
  parser.add_argument("--dtypes", default="bfloat16,float32")
  parser.add_argument("--directions", default="fwd,fwd+bwd")
  parser.add_argument("--programs", default=",".join(p for p, _ in TABLE))
  parser.add_argument("--sweep", action="store_true", help="FlashFFN block sizes instead")
  parser.add_argument("--readme", action="store_true", help="rewrite benchmarks/README.md's table")
  parser.add_argument("--table", action="store_true",
                      help="no compiles: the table of the results in perf.json")
  parser.add_argument("--timeout", type=float, default=900.0)
  parser.add_argument("--max-rss-gb", type=float, default=16.0)
  args = parser.parse_args(argv)
  targets, dtypes = args.targets.split(","), args.dtypes.split(",")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  if args.sweep:
    best = sweep(targets, dtypes, args.timeout, args.max_rss_gb, log)
    print(json.dumps(best, indent=1))
    return 0
  results = []
  rows = itertools.product(targets, args.programs.split(","), args.directions.split(","), dtypes)
  for target, program, direction, dtype in ([] if args.table else rows):
    r = run_row(target, program, direction, dtype, args.timeout, args.max_rss_gb)
    results.append(r)
    RESULTS.write_text(json.dumps(_merge(RESULTS, [r]), indent=1) + "\n")  # kept if cut short
    log(f"{target} {dtype} {direction} {program}: "
        + (f"{r['cycles']:,} cycles in {r['compile_s']} s" if r["status"] == "ok"
           else f"{r['status']}: {r.get('error', '')[:100]}"))
  results = _merge(RESULTS, results)
  text = table(sorted(results, key=lambda r: (r["target"], r["dtype"], r["direction"],
                                              [p for p, _ in TABLE].index(r["program"])
                                              if r["program"] in dict(TABLE) else 99)))
  print(text)
  if args.readme:
    replace_section(README, BEGIN, END, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
