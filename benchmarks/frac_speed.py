"""FRAC scan speed on CPU: chunked XLA path (M = 16 vs M = 1) against a sequential
`lax.scan` and `lax.associative_scan` of the same recurrence, and decoding time per token.

Forward + backward (gradients of every float input) at B = 1, H = 4, P = 64, N = 16.
Prints markdown tables for benchmarks/README.md:
  JAX_PLATFORMS=cpu python -m benchmarks.frac_speed [--lengths 4096 8192 16384]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import wall_seconds
from neurips26_jax.jaxops import frac

HEADS, P, N = 4, 64, 16
# lax.associative_scan keeps [L, H, M, N, P] elements per level: skipped above this many.
ASSOCIATIVE_MAX_ELEMENTS = 2**27


def inputs(length: int, modes: int):
  ks = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(ks[0], (1, length, HEADS, P))
  dt = jax.nn.softplus(jax.random.normal(ks[1], (1, length, HEADS)))
  b, c = 0.25 * jax.random.normal(ks[2], (2, 1, length, HEADS, N))
  if modes == 1:  # Mamba-2: one mode of weight 1
    rates, weights = jnp.geomspace(1.0 / length, 1.0, HEADS)[:, None], jnp.ones((HEADS, 1))
  else:
    rates, weights = frac.soe_modes(jnp.linspace(0.2, 0.9, HEADS), num_modes=modes,
                                    context=length)
  return x, dt, b, c, rates, weights


def associative_scan(x, dt, b, c, rates, weights):
  """The recurrence S_t = a_t S_{t-1} + u_t with lax.associative_scan over all tokens."""
  decay = jnp.exp(-rates * dt[..., None])                                 # [1, L, H, M]
  update = jnp.einsum("blh,blhn,blhp->blhnp", dt, b, x)[:, :, :, None]    # [1, L, H, 1, N, P]
  update = jnp.broadcast_to(update, decay.shape + update.shape[-2:])

  def combine(left, right):
    (a_l, u_l), (a_r, u_r) = left, right
    return a_l * a_r, a_r[..., None, None] * u_l + u_r

  _, states = jax.lax.associative_scan(combine, (decay, update), axis=1)
  y = jnp.einsum("hm,blhn,blhmnp->blhp", weights, c, states)
  return y, states[:, -1]


def fwd_bwd(op):
  """Forward plus gradients of every float input."""
  loss = lambda *a: jnp.sum(op(*a)[0] ** 2)
  return jax.grad(loss, argnums=tuple(range(6)))


def interleaved_seconds(runs: dict, rounds: int = 4) -> dict:
  """Best wall time of each compiled jit(fn)(*args) in `runs` {name: (fn, args)}, timed in
  alternation so that load from other processes hits every variant alike."""
  compiled = {k: (jax.jit(fn).lower(*args).compile(), args) for k, (fn, args) in runs.items()}
  best = dict.fromkeys(runs, float("inf"))
  for _ in range(rounds):
    for k, (fn, args) in compiled.items():
      jax.block_until_ready(fn(*args))  # warm-up in round 0, timed below
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[k] = min(best[k], time.perf_counter() - start)
  return best


def scan_table(lengths) -> None:
  print("| L | chunked M=16 (ms) | chunked M=1 (ms) | M=16 / M=1 | sequential M=16 (ms) "
        "| chunked speed-up vs sequential | associative M=16 (ms) | associative M=1 (ms) |")
  print("|---|---|---|---|---|---|---|---|")
  for length in lengths:
    args = {m: inputs(length, m) for m in (16, 1)}
    t = interleaved_seconds({("chunked", m): (fwd_bwd(frac.frac_scan), args[m]) for m in args})
    t["sequential", 16] = wall_seconds(fwd_bwd(frac.frac_scan_reference), *args[16], repeats=1)
    for m in args:
      if length * HEADS * m * N * P <= ASSOCIATIVE_MAX_ELEMENTS:
        t["associative", m] = wall_seconds(fwd_bwd(associative_scan), *args[m], repeats=1)
    ms = lambda key: f"{t[key] * 1e3:,.0f}" if key in t else "skipped (memory)"
    print(f"| {length} | {ms(('chunked', 16))} | {ms(('chunked', 1))} "
          f"| {t['chunked', 16] / t['chunked', 1]:.2f}x | {ms(('sequential', 16))} "
          f"| {t['sequential', 16] / t['chunked', 16]:.1f}x | {ms(('associative', 16))} "
          f"| {ms(('associative', 1))} |", flush=True)


def decode_table(contexts, modes: int = 16, tokens: int = 200, rounds: int = 3) -> None:
  """Per-token time of `frac_step` after a prefill of `context` tokens (state from frac_scan).

  The step inputs are sliced before timing, so only the step itself is timed; best of
  `rounds` passes over `tokens` steps.
  """
  print("\n| context | modes | decode time per token (us) | state numbers per head |")
  print("|---|---|---|---|")
  step = jax.jit(frac.frac_step)
  for context in contexts:
    x, dt, b, c, rates, weights = inputs(context, modes)
    _, prefilled = jax.jit(frac.frac_scan)(x, dt, b, c, rates, weights)
    steps = jax.block_until_ready([(x[:, t], dt[:, t], b[:, t], c[:, t]) for t in range(tokens)])
    jax.block_until_ready(step(prefilled, *steps[0], rates, weights))  # compile
    best = float("inf")
    for _ in range(rounds):
      state = prefilled
      start = time.perf_counter()
      for x_t, dt_t, b_t, c_t in steps:
        _, state = step(state, x_t, dt_t, b_t, c_t, rates, weights)
      jax.block_until_ready(state)
      best = min(best, (time.perf_counter() - start) / tokens)
    print(f"| {context} | {modes} | {best * 1e6:,.0f} | {state[0, 0].size} |", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
  parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 65536])
  args = parser.parse_args()
  print(f"devices: {jax.devices()}\n")
  scan_table(args.lengths)
  decode_table(args.contexts)


if __name__ == "__main__":
  main()
