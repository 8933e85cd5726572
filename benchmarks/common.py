"""Helpers shared by the benchmarks: compiled temp memory and side-by-side wall time."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def temp_bytes(fn, *args) -> int:
  """XLA's compiled temp allocation for jit(fn)(*args): activation memory on CPU."""
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def wall_seconds(fn, *args, repeats: int = 3) -> float:
  """Best of `repeats` wall times of jit(fn)(*args) after one warm-up call."""
  compiled = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(compiled(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
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
