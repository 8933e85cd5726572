"""Forward+backward CPU wall time and compiled temp memory of Pack3D attention vs dense
and vs local-window-only attention.

One field of N tokens (a 3D grid of 4^3 cubes), batch 1, 2 heads of width 48, float32:
  dense         jax.nn.dot_product_attention (XLA), every token against every token
  local window  1D sliding window over the raster-ordered sequence: each 64-token chunk
                attends to the 27 chunks around it (1728 keys, as many as Pack3D's
                local branch), chunked and checkpointed like the Pack3D XLA path
  pack3d        jaxops.pack3d.pack3d_attention (XLA path): 27 neighbour cubes + N/64 summaries
  pack3d L=k    the same with the multi-level far field, `levels=k` (DESIGN.md 3.1): 27
                neighbour cubes + 189 summaries per level below the top + the top's
Time: best of `--repeats` runs of jit(grad) after a warm-up. Memory: XLA's
temp_size_in_bytes of the compiled gradient. A variant whose temp memory exceeds
`--max_gib` is compiled (memory reported) but not run.

  python -m benchmarks.pack3d_speed --sizes=4096,16384,65536
  python -m benchmarks.pack3d_speed --sizes=65536,262144,1048576 --levels=3,4 --skip_dense
  python -m benchmarks.pack3d_speed --sizes=16384,65536,262144,1048576 --levels=3 \
      --skip_dense --skip_one_level          # the multi-level growth alone
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import mib, temp_bytes, wall_seconds
from neurips26_jax.jaxops import packing
from neurips26_jax.jaxops.pack3d import pack3d_attention

_SIZES = flags.DEFINE_list("sizes", ["4096", "16384", "65536"], "Token counts N.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed runs per variant (best is reported).")
_MAX_GIB = flags.DEFINE_float("max_gib", 8.0, "Do not run variants needing more temp memory.")
_LEVELS = flags.DEFINE_list("levels", ["3"], "Multi-level variants to add (levels >= 2).")
_SKIP_DENSE = flags.DEFINE_bool("skip_dense", False, "Leave out dense and the local window.")
_SKIP_ONE_LEVEL = flags.DEFINE_bool("skip_one_level", False,
                                    "Leave out the single-level XLA path (its far term is N^2/64).")
HEADS, HEAD_DIM, CUBE, WINDOW = 2, 48, 64, 27
FIELDS = {4096: (16, 16, 16), 16384: (16, 32, 32), 65536: (32, 32, 64), 262144: (64, 64, 64),
          1048576: (64, 128, 128)}


def local_window_attention(q, k, v, *, chunk=CUBE, window=WINDOW, group=16):
  """Each `chunk` of queries attends to the `window` chunks centred on it (zero-padded at
  the ends, masked). q, k, v [1, N, H, D], N a multiple of chunk."""
  n, h, d = q.shape[1:]
  chunks = n // chunk
  pad = window // 2
  kc, vc = (jnp.pad(x[0].reshape(chunks, chunk, h, d), ((pad, pad), (0, 0), (0, 0), (0, 0)))
            for x in (k, v))
  valid = jnp.pad(jnp.ones(chunks, bool), (pad, pad))
  qc = q[0].reshape(chunks // group, group, chunk, h, d)

  def step(args):
    qg, first = args
    ids = first + jnp.arange(group)[:, None] + jnp.arange(window)[None]   # [group, window]
    kw, vw = (x[ids].reshape(group, window * chunk, h, d) for x in (kc, vc))
    mask = jnp.repeat(valid[ids], chunk, axis=1)[:, None, None, :]
    s = jnp.einsum("gqhd,gkhd->ghqk", qg, kw) / math.sqrt(d)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    return jnp.einsum("ghqk,gkhd->gqhd", p, vw)

  o = jax.lax.map(jax.checkpoint(step), (qc, jnp.arange(0, chunks, group)))
  return o.reshape(1, n, h, d)


def variants(n: int):
  _, coords, field_ids = packing.pack_fields([np.zeros(FIELDS[n] + (1,))])
  coords, field_ids = coords[None], field_ids[None]
  out = {} if _SKIP_DENSE.value else {
      "dense": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"),
      "local window": local_window_attention}
  if not _SKIP_ONE_LEVEL.value:
    out["pack3d (XLA path)"] = lambda q, k, v: pack3d_attention(q, k, v, coords, field_ids)
  for levels in (int(x) for x in _LEVELS.value):
    out[f"pack3d L={levels}"] = lambda q, k, v, levels=levels: pack3d_attention(
        q, k, v, coords, field_ids, levels=levels)
  return out


def fwd_bwd(op):
  """Gradient of <op(q, k, v), g> in q, k, v (one forward and one backward)."""
  return jax.grad(lambda q, k, v, g: jnp.sum(op(q, k, v) * g), argnums=(0, 1, 2))


def main(_):
  print("| N | variant | fwd+bwd s | temp MiB | dense / variant time | dense / variant memory |")
  print("|---|---|---|---|---|---|")
  for n in (int(s) for s in _SIZES.value):
    keys = jax.random.split(jax.random.key(n), 4)
    args = [jax.random.normal(kk, (1, n, HEADS, HEAD_DIM), jnp.float32) for kk in keys]
    results = {}
    for name, op in variants(n).items():
      fn = fwd_bwd(op)
      memory = temp_bytes(fn, *args)
      seconds = (wall_seconds(fn, *args, repeats=_REPEATS.value)
                 if memory <= _MAX_GIB.value * 2**30 else None)
      results[name] = (seconds, memory)
      dense_s, dense_m = results.get("dense", (None, None))
      ratio_t = f"{dense_s / seconds:.1f}x" if seconds and dense_s else "-"
      ratio_m = f"{dense_m / memory:.1f}x" if dense_m else "-"
      time_s = f"{seconds:.2f}" if seconds else f"not run (> {_MAX_GIB.value:g} GiB)"
      print(f"| {n} | {name} | {time_s} | {mib(memory)} | {ratio_t} | {ratio_m} |", flush=True)


if __name__ == "__main__":
  app.run(main)
