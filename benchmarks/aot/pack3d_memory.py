"""HBM temp of one Pack3D attention layer, forward plus backward, from the real compiler.

`compiled.memory_analysis().temp_size_in_bytes` of a `Pack3DAttention` layer's VJP (of x
and every parameter, the upstream gradient an argument) at the segmentation width (d = 96,
4 heads of 24, cubes of 4^3, radius 1), one field of N tokens (a z x y x x grid), traced
coordinates, for the Pallas kernel and the XLA path, each with one and with `--levels`
far-field levels (the top level's slots bounded by the grid's top-level box,
`max_top_cubes`, as a user of traced coordinates would set it). The last column is the unpadded bytes of the layer's
[N, d] activations that any implementation keeps (x, q, k, v, o and their gradients:
10 N d elements), the scale the kernel's padded slot arrays are measured against.

  .venv-aot-tpu/bin/python -m benchmarks.aot.pack3d_memory --target=tpu-v5e
"""

from __future__ import annotations

import argparse
import math
import os

from benchmarks.aot.targets import TARGETS, environment

D_MODEL, HEADS, BLOCK = 96, 4, (4, 4, 4)
GRIDS = {65536: (64, 32, 32), 262144: (64, 64, 64), 1048576: (64, 128, 128)}


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--target", default="tpu-v5e", choices=sorted(TARGETS))
  parser.add_argument("--sizes", default="262144,1048576")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--levels", default="3", help="multi-level variants (kernel and XLA)")
  args = parser.parse_args(argv)
  target = TARGETS[args.target]
  for key, value in environment(target).items():
    os.environ.setdefault(key, value)
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.aot.targets import temp_bytes_on
  from neurips26_jax.models import Pack3DAttention

  spec, temp = temp_bytes_on(target)
  dtype = jnp.dtype(args.dtype)

  def layer_temp(n, impl, levels):
    per_axis = [-(-g // b) for g, b in zip(GRIDS[n], BLOCK)]
    top = {"max_top_cubes": math.prod(-(-c // 2 ** (levels - 1)) for c in per_axis)
           } if levels > 1 else {}
    layer = Pack3DAttention(D_MODEL, HEADS, block_shape=BLOCK, impl=impl, levels=levels,
                            max_cubes=math.prod(per_axis), dtype=dtype, rngs=nnx.Rngs(0),
                            **top)
    graphdef, params = nnx.split(layer)

    def step(params, x, coords, field_ids, dy):
      call = lambda p, x: nnx.merge(graphdef, p)(x, coords, field_ids)
      return jax.vjp(call, params, x)[1](dy)

    params = jax.tree.map(lambda p: spec(p.shape, p.dtype), params)
    x = spec((1, n, D_MODEL), dtype)
    return temp(step, params, x, spec((1, n, 3), jnp.int32), spec((1, n), jnp.int32), x)

  levels = [int(k) for k in args.levels.split(",")]
  variants = {"kernel, 1 level": ("pallas", 1)}
  variants.update({f"kernel, {k} levels": ("pallas", k) for k in levels})
  variants["XLA path, 1 level"] = ("xla", 1)
  variants.update({f"XLA path, {k} levels": ("xla", k) for k in levels})
  sizes = [int(n) for n in args.sizes.split(",")]
  gib = lambda b: f"{b / 2**30:.2f}"
  print(f"\n{target.name}, {args.dtype}: one Pack3DAttention layer (d={D_MODEL}, H={HEADS}), "
        "fwd+bwd temp GiB")
  print("| N | " + " | ".join(variants) + " | unpadded x, q, k, v, o + grads |")
  print("|---|" + "---|" * (len(variants) + 1))
  for n in sizes:
    row = [gib(layer_temp(n, *v)) for v in variants.values()]
    unpadded = 10 * n * D_MODEL * dtype.itemsize
    print(f"| {n:,} | " + " | ".join(row) + f" | {gib(unpadded)} |", flush=True)


if __name__ == "__main__":
  main()
