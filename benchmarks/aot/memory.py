"""FlashFFN vs SwiGLU activation memory from the real TPU / GPU compilers.

The paper's memory claim is about chips, so it is measured on what the chips' compilers
allocate: `compiled.memory_analysis().temp_size_in_bytes` of one FFN layer's forward
plus backward (the VJP of x and every parameter, given the upstream gradient dy; x, dy
and the parameters are arguments, not temp), at the 370M shape (d=1024, H=8, E=11,
d_e=256 against SwiGLU d_ff=2752), batch 1. Rows: the whole layer (projections, head
norm and router included) and the op alone (mhffn kernel vs the SwiGLU product).

  .venv-aot-tpu/bin/python -m benchmarks.aot.memory --target=tpu-v5e
  .venv-aot-gpu/bin/python -m benchmarks.aot.memory --target=gpu-h100
(`make memory-aot` runs both and prints markdown for benchmarks/README.md.)
"""

from __future__ import annotations

import argparse
import os

from benchmarks.aot.targets import TARGETS, environment

D, HEADS, EXPERTS, D_E, D_FF_SWIGLU = 1024, 8, 11, 256, 2752


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--target", default="tpu-v5e", choices=sorted(TARGETS))
  parser.add_argument("--lengths", default="4096,8192,16384,32768")
  parser.add_argument("--dtypes", default="bfloat16,float32")
  args = parser.parse_args(argv)
  target = TARGETS[args.target]
  for key, value in environment(target).items():
    os.environ.setdefault(key, value)
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.aot.targets import temp_bytes_on
  from benchmarks.flash_ffn_memory import fwd_bwd
  from neurips26_jax.models import FlashFFN, SwiGLU
  from neurips26_jax.pallas_kernels.flash_ffn import mhffn

  spec, temp = temp_bytes_on(target)

  def layer_temp(layer, n, dtype):
    step, params = fwd_bwd(layer, remat=False)
    params = jax.tree.map(lambda p: spec(p.shape, p.dtype), params)
    return temp(step, params, spec((1, n, D), dtype), spec((1, n, D), dtype))

  def op_temp(kind, n, dtype):
    d_h = D // HEADS
    if kind == "mhffn":
      table = spec((HEADS, EXPERTS, D_E, d_h), dtype)
      args = (spec((1, n, HEADS, d_h), dtype), spec((1, n, HEADS, EXPERTS), jnp.float32),
              table, table, table)
      out = (1, n, HEADS, d_h)
      f = lambda *a: mhffn(*a)
    else:
      args = (spec((1, n, D), dtype), spec((D, D_FF_SWIGLU), dtype),
              spec((D, D_FF_SWIGLU), dtype), spec((D_FF_SWIGLU, D), dtype))
      out = (1, n, D)
      f = lambda x, g, u, dn: (jax.nn.silu(x @ g) * (x @ u)) @ dn
    step = lambda dy, *a: jax.vjp(f, *a)[1](dy)
    return temp(step, spec(out, dtype), *args)

  lengths = [int(n) for n in args.lengths.split(",")]
  mib = lambda b: f"{b / 2**20:,.0f}"
  print(f"\n{target.name}: fwd+bwd temp MiB (ratio SwiGLU / FlashFFN)")
  print("| dtype | what | " + " | ".join(f"L={n}" for n in lengths) + " |")
  print("|---|---|" + "---|" * len(lengths))
  for dtype_name in args.dtypes.split(","):
    dtype = jnp.dtype(dtype_name)
    rngs = lambda: nnx.Rngs(0)
    swiglu = SwiGLU(D, D_FF_SWIGLU, dtype=dtype, rngs=rngs())
    flash = FlashFFN(D, HEADS, EXPERTS, D_E, impl="pallas", dtype=dtype, rngs=rngs())
    rows = {"layer SwiGLU": [layer_temp(swiglu, n, dtype) for n in lengths],
            "layer FlashFFN (kernel)": [layer_temp(flash, n, dtype) for n in lengths],
            "op SwiGLU product": [op_temp("swiglu", n, dtype) for n in lengths],
            "op mhffn kernel": [op_temp("mhffn", n, dtype) for n in lengths]}
    for name, values in rows.items():
      print(f"| {dtype_name} | {name} | " + " | ".join(mib(v) for v in values) + " |", flush=True)
    for what in ("layer", "op"):
      base, ours = [v for k, v in rows.items() if k.startswith(what)]
      print(f"| {dtype_name} | **{what}: SwiGLU / FlashFFN** | "
            + " | ".join(ratio(b, o) for b, o in zip(base, ours)) + " |")


def ratio(base: int, ours: int) -> str:
  """SwiGLU / FlashFFN, or why there is none: a side under 1 MiB means XLA placed its
  intermediates in argument and output buffers, and no quotient of that says anything."""
  small = [name for name, v in (("SwiGLU", base), ("FlashFFN", ours)) if v < 2**20]
  return f"- ({' and '.join(small)} < 1 MiB)" if small else f"**{base / ours:.2f}x**"


if __name__ == "__main__":
  main()
