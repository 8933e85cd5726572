"""The compile check: every kernel, forward and gradient, f32 and bf16, through the real
TPU and GPU compilers, with a table of what each compiler reports.

  python -m benchmarks.aot.check                       # all targets, all ops
  python -m benchmarks.aot.check --targets=tpu-v5e,tpu-v6e --ops=flash_ffn
  python -m benchmarks.aot.check --readme              # also rewrite benchmarks/README.md's table
  python -m benchmarks.aot.check --targets=gpu-h100 --ops=flash_ffn --merge --readme
                                       # one target's op anew, every other row from results.json
  python -m benchmarks.aot.check --ops=pack3d --shapes=1m --merge --readme   # one shape anew
  python -m benchmarks.aot.check --ci --targets=tpu-v5e,tpu-v6e   # CI's subset (cases.ci_cases)

Each target's cases run in a worker process inside that target's venv (`make
compile-check` creates .venv-aot-tpu and .venv-aot-gpu from pinned versions). A case
passes when it compiles in under 60 s and, on GPU, every kernel spills at most 1 KiB;
the oversized cases pass when the compiler rejects them. Exit status 1 if any case fails.
Results: benchmarks/aot/results.json and the markdown table benchmarks/aot/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

from benchmarks.aot import cases as cases_lib
from benchmarks.aot.targets import TARGETS, environment
from tools.readme_section import replace_section

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = pathlib.Path(__file__).parent
MAX_COMPILE_S = 60.0
MAX_SPILL_BYTES = 1024
README = ROOT / "benchmarks" / "README.md"
BEGIN, END = "<!-- compile-check:begin -->", "<!-- compile-check:end -->"


def run_target(target, cases, timeout: float) -> list[dict]:
  """Compiles `cases` for `target` in worker processes; a case past `timeout` is recorded
  as such (its process group killed: ptxas runs as a child) and the rest resume. On Hopper
  and Blackwell targets every case gets its own process: Mosaic GPU compiles a kernel once
  per process (the same forward kernel in a later gradient case would have no ptxas
  report)."""
  python = ROOT / target.venv / "bin" / "python"
  if not python.exists():
    sys.exit(f"compile check: {python} is missing; run `make compile-check` (it creates "
             f"{target.venv} with the pinned compiler packages)")
  env = dict(os.environ, PYTHONPATH=str(ROOT), **environment(target))
  batches = [[c] for c in cases] if target.mosaic_gpu else [list(cases)]
  return [r for batch in batches for r in _run_batch(target, python, env, batch, timeout)]


def _run_batch(target, python, env, cases, timeout: float) -> list[dict]:
  pending, results = list(cases), []
  while pending:
    proc = subprocess.Popen(
        [str(python), "-m", "benchmarks.aot.worker", f"--target={target.name}",
         "--cases=" + ";".join(c.name for c in pending)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    current, deadline = None, time.monotonic() + timeout
    while True:
      ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
      if not ready:  # the current case ran past the deadline
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        current = current or pending[0]
        results.append({"case": current.name, "target": target.name, "status": "timeout",
                        "error": f"no result after {timeout:.0f} s",
                        "expect_failure": current.expect_failure, "compile_s": timeout})
        print(_line(results[-1]), flush=True)
        pending = pending[pending.index(current) + 1:]
        break
      line = proc.stdout.readline()
      if not line:  # the worker exited
        proc.wait()
        if pending:
          err = proc.stderr.read()[-2000:]
          failed = current or pending[0]
          results.append({"case": failed.name, "target": target.name, "status": "error",
                          "error": f"worker exited with {proc.returncode}: {err}",
                          "expect_failure": failed.expect_failure, "compile_s": 0.0})
          print(_line(results[-1]), flush=True)
          pending = pending[pending.index(failed) + 1:]
        break
      if line.startswith("START "):
        current = next(c for c in pending if c.name == line.split()[1])
        deadline = time.monotonic() + timeout
      elif line.startswith("RESULT "):
        results.append(json.loads(line[len("RESULT "):]))
        print(_line(results[-1]), flush=True)
        pending.remove(current)
        current, deadline = None, time.monotonic() + timeout
  return results


def verdict(result: dict) -> str:
  """'' when the case passes, else why not."""
  if result.get("expect_failure"):  # must be refused for lack of on-chip memory
    error = result.get("error", "")
    refused = result["status"] == "error" and (
        "RESOURCE_EXHAUSTED" in error or "exceeds available shared memory" in error)
    return "" if refused else "an oversized block was not refused for its memory"
  if result["status"] != "ok":
    return result["status"]
  if not result.get("kernels"):
    return "no Pallas kernel in the compiled program"
  if result["compile_s"] > MAX_COMPILE_S:
    return f"compile took {result['compile_s']:.0f} s"
  for name, k in result["kernels"].items():
    spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
    if spill > MAX_SPILL_BYTES:
      return f"{name} spills {spill} B"
  return ""


def _kib(n) -> str:
  return "-" if n is None else f"{n / 1024:,.0f}K"


def _mib(n) -> str:
  return f"{n / 2**20:,.1f}M"


def _line(r: dict) -> str:
  bad = verdict(r)
  head = (f"{'FAIL' if bad else 'ok  '} {r['target']:9s} {r['case']:42s} {r['compile_s']:6.1f}s"
          f" (cpu {r.get('cpu_s', 0.0):5.1f}s)")
  if r["status"] != "ok":
    return f"{head}  {r['status']}: {r.get('error', '')[:160]}"
  parts = []
  for name, k in r["kernels"].items():
    if "vmem" in k:
      parts.append(f"{name} vmem {_kib(k['vmem'])}")
    else:
      parts.append(f"{name} smem {_kib(k.get('smem'))} regs {k.get('registers')} "
                   f"spill {k.get('spill_stores', 0)}/{k.get('spill_loads', 0)}")
  return f"{head}  hbm temp {_mib(r['hbm_temp'])}; " + "; ".join(parts) + (f"  <- {bad}" if bad else "")


def markdown(results: list[dict]) -> str:
  """One table per target kind: rows = case x kernel, columns = targets."""
  out = []
  for kind, what in (("tpu", "scoped VMEM per kernel · HBM temp of the program · compile s"),
                     ("gpu", "shared memory · registers/thread · spill stores+loads (B) · "
                             "compile s of the program")):
    names = [t for t in TARGETS if TARGETS[t].kind == kind]
    rows = [r for r in results if TARGETS[r["target"]].kind == kind]
    if not rows:
      continue
    out.append(f"| {kind.upper()}: {what} | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    by = {(r["case"], r["target"]): r for r in rows}
    for case in dict.fromkeys(r["case"] for r in rows):
      kernels = list(dict.fromkeys(k for t in names for k in by.get((case, t), {}).get("kernels", {})))
      for kernel in kernels or [None]:
        cells = []
        for t in names:
          r = by.get((case, t))
          if r is None:
            cells.append("")
            continue
          bad = verdict(r)
          if r["status"] != "ok":
            msg = r.get("error", "").split("\n")[0][:90].replace("|", "/")
            cells.append(("expected failure: " if not bad else "**FAIL** ") + r["status"] + ": " + msg)
            continue
          if kernel not in r["kernels"]:  # a kernel this target's backend does not have
            cells.append("")
            continue
          k = r["kernels"][kernel]
          if kind == "tpu":
            cell = f"{_kib(k.get('vmem'))} · {_mib(r['hbm_temp'])} · {r['compile_s']:.1f}"
          else:
            spill = k.get("spill_stores", 0) + k.get("spill_loads", 0)
            cell = (f"{_kib(k.get('smem'))} · {k.get('registers')} · {spill} · "
                    f"{r['compile_s']:.1f}")
          cells.append(f"**FAIL** ({bad}) {cell}" if bad else cell)
        out.append(f"| {case} {kernel or ''} | " + " | ".join(cells) + " |")
    out.append("")
  return "\n".join(out)


def merge(previous: list[dict], results: list[dict], whole_ops: bool = True) -> list[dict]:
  """`results` with the `previous` rows they do not cover, in target order: a run of some
  targets or ops replaces every old row of those (target, op) pairs (cases that no longer
  exist included); with whole_ops=False (a run of some shapes) only the rows of the
  (target, op, shape) triples that ran."""
  part = lambda r: tuple(r["case"].split("/")[:1 if whole_ops else 2])
  redone = {(r["target"], part(r)) for r in results}
  kept = [r for r in previous if (r["target"], part(r)) not in redone]
  return sorted(kept + results, key=lambda r: list(TARGETS).index(r["target"]))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--targets", default=",".join(TARGETS))
  parser.add_argument("--ops", default="", help="comma-separated subset of ops (default all)")
  parser.add_argument("--shapes", default="",
                      help="comma-separated subset of shapes (default all; no oversized cases)")
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
  parser.add_argument("--readme", action="store_true", help="rewrite benchmarks/README.md's table")
  parser.add_argument("--out", default=str(HERE / "results"), help="results .json/.md prefix")
  parser.add_argument("--ci", action="store_true", help="only CI's subset (cases.ci_cases)")
  parser.add_argument("--merge", action="store_true",
                      help="keep the previous results (--out's .json) of the (target, op) pairs not run")
  args = parser.parse_args(argv)
  ops = set(filter(None, args.ops.split(","))) or None
  shapes = set(filter(None, args.shapes.split(","))) or None
  results, start = [], time.monotonic()
  for name in args.targets.split(","):
    if name not in TARGETS:
      sys.exit(f"compile check: unknown target {name!r}; expected some of {sorted(TARGETS)}")
    target = TARGETS[name]
    cases = cases_lib.all_cases(target.kind, ops, shapes, target.generation)
    results += run_target(target, cases_lib.ci_cases(cases) if args.ci else cases, args.timeout)
  elapsed = time.monotonic() - start
  ran = sorted({r["target"] for r in results}, key=list(TARGETS).index)
  if args.merge and (previous := pathlib.Path(args.out + ".json")).exists():
    results = merge(json.loads(previous.read_text()), results, whole_ops=shapes is None)
  failures = [r for r in results if verdict(r)]
  load = os.getloadavg()[2]
  summary = (f"{len(results) - len(failures)}/{len(results)} cases pass ({len(failures)} "
             f"failing); this run: {', '.join(ran)} in {elapsed:.0f} s, load average over "
             f"the last 15 min {load:.1f} on {os.cpu_count()} cores")
  print(summary)
  table = markdown(results)
  pathlib.Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
  pathlib.Path(args.out + ".md").write_text(table + "\n" + summary + "\n")
  if args.readme:
    replace_section(README, BEGIN, END, table + "\n" + summary)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
