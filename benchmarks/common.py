"""Helpers shared by the benchmarks: compiled temp memory, side-by-side wall time, checks
against references (each in its own process where a kernel may fault)."""

from __future__ import annotations

import subprocess
import sys
import time

import jax
import jax.numpy as jnp

_COMPILED = {}


def compiled(fn, *args):
  """jit(fn) compiled for the shapes and dtypes of args (arrays or ShapeDtypeStructs).

  Memoized, so measuring a function's memory and then its time compiles it once.
  """
  leaves, tree = jax.tree.flatten(args)
  key = (fn, tree, tuple((x.shape, jnp.dtype(x.dtype)) for x in leaves))
  if key not in _COMPILED:
    _COMPILED[key] = jax.jit(fn).lower(*args).compile()
  return _COMPILED[key]


def temp_bytes(fn, *args) -> int:
  """XLA's compiled temp allocation for jit(fn)(*args): activation memory on CPU."""
  return compiled(fn, *args).memory_analysis().temp_size_in_bytes


def wall_seconds(fn, *args, repeats: int = 3) -> float:
  """Best of `repeats` wall times of jit(fn)(*args) after one warm-up call."""
  compiled_fn = compiled(fn, *args)
  jax.block_until_ready(compiled_fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled_fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def mib(n: int) -> str:
  return f"{n / 2**20:,.0f}"


def report_errors(label: str, names, values, references, tol: float) -> bool:
  """Prints each value's max error relative to max|reference|; True when all are <= tol."""
  ok = True
  for name, value, ref in zip(names, values, references, strict=True):
    ref = jnp.asarray(ref, jnp.float32)
    err = float(jnp.max(jnp.abs(jnp.asarray(value, jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    ok &= err <= tol
    print(f"  {label} {name}: rel. max error {err:.2e} ({'ok' if err <= tol else 'FAIL'})",
          flush=True)
  return ok


def check_in_subprocess(module: str, *args: str) -> bool:
  """`python -m <module> check <args>` in its own process: a kernel fault (a CUDA error
  poisons the process's context) is reported as that check's failure and the others still
  run. The module prints its own result lines (report_errors)."""
  done = subprocess.run([sys.executable, "-m", module, "check", *args], capture_output=True,
                        text=True, check=False)
  print(done.stdout, end="", flush=True)
  if done.returncode != 0 and "(FAIL)" not in done.stdout:
    errors = [l for l in done.stderr.splitlines() if "Error" in l or "error:" in l]
    print(f"  {' '.join(args)}: crashed (exit {done.returncode}): {(errors or ['?'])[-1][:300]}",
          flush=True)
  return done.returncode == 0
