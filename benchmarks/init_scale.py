"""The layers at initialisation, before and after the defaults that make them train:

  python -m benchmarks.init_scale

1. FlashFFN vs SwiGLU (d = 128, unit-RMS input [4, 256, 128], unit-RMS output cotangent): output
   RMS, input-gradient RMS and parameter-gradient RMS, for the paper's init (N(0, 0.02) tables,
   Xavier 0.707 projections: the old default) and the library's "scaled" default, at H = 4, 2, 1
   heads (E = 2, d_e = 128, SwiGLU d_ff = 344: both 131-132k parameters).
2. FRAC: per head, alpha at init and d alpha / d logit = (1 - alpha_min) sigmoid'(logit), with the
   old default (alpha_min 0.2, heads over [0.2, 0.9], the lowest clipped to a sigmoid of 1e-3)
   and the new one (alpha_min 0.05, sigmoids over [0.15, 0.85]).
3. Which parameters AdamW decays: the old rule (every ndim >= 2 leaf) and `train.optim.decay_mask`.
4. Pack3D: the share of attention mass on far-cube summaries at init, on the seg3d experiment's
   shapes (configs/exp_seg3d_cpu.py, first layer, real voxel tokens), with the log(n_b) bias
   (the default; a learnable per-head offset starting at 0 leaves it unchanged at init) and
   without it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from neurips26_jax.configs import exp_seg3d_cpu
from neurips26_jax.jaxops import rope
from neurips26_jax.models.flash_ffn import FlashFFN, SwiGLU
from neurips26_jax.models.frac import FRACMixer
from neurips26_jax.train import optim, seg3d_task

rms = lambda a: float(jnp.sqrt(jnp.mean(jnp.square(a))))


def _grad_stats(layer, x, dy):
  """(output RMS, dx RMS, RMS over all parameter-gradient entries)."""
  graphdef, params = nnx.split(layer, nnx.Param)
  f = lambda p, x: nnx.merge(graphdef, p)(x)
  y, vjp = jax.vjp(f, params, x)
  dp, dx = vjp(dy)
  leaves = jax.tree.leaves(dp)
  dp_rms = math.sqrt(sum(float(jnp.sum(g * g)) for g in leaves) / sum(g.size for g in leaves))
  return rms(y), rms(dx), dp_rms


def flashffn_table():
  x = jax.random.normal(jax.random.key(0), (4, 256, 128))
  dy = jax.random.normal(jax.random.key(1), x.shape)
  ref = _grad_stats(SwiGLU(128, 344, rngs=nnx.Rngs(0)), x, dy)
  print("## FlashFFN(128, H, E=2, d_e=128) vs SwiGLU(128, 344) at init\n")
  print("| layer | init | out RMS | dx RMS | param-grad RMS | out / SwiGLU | dx / SwiGLU |")
  print("|---|---|---|---|---|---|---|")
  print(f"| SwiGLU | lecun | {ref[0]:.3g} | {ref[1]:.3g} | {ref[2]:.3g} | 1 | 1 |")
  for heads in (4, 2, 1):
    for init in ("paper", "scaled"):
      layer = FlashFFN(128, heads, 2, 128, init=init, impl="xla", rngs=nnx.Rngs(0))
      s = _grad_stats(layer, x, dy)
      print(f"| FlashFFN H={heads} (d_h={128 // heads}) | {init} | {s[0]:.3g} | {s[1]:.3g} | "
            f"{s[2]:.3g} | {s[0] / ref[0]:.3g} | {s[1] / ref[1]:.3g} |")


def frac_table(heads: int = 4):
  old = FRACMixer(64, num_heads=heads, head_dim=16, context=256, alpha_min=0.2,
                  alpha_init=np.linspace(0.2, 0.9, heads), rngs=nnx.Rngs(0))
  new = FRACMixer(64, num_heads=heads, head_dim=16, context=256, rngs=nnx.Rngs(0))
  print(f"\n## FRAC alpha at init ({heads} heads)\n")
  print("| default | alpha_min | alpha per head | d alpha / d logit per head |")
  print("|---|---|---|---|")
  for name, layer in (("old", old), ("new", new)):
    s = jax.nn.sigmoid(layer.alpha_logit[...])
    slope = (1 - layer.alpha_min) * s * (1 - s)
    alpha = ", ".join(f"{a:.3f}" for a in np.asarray(layer.alpha()))
    print(f"| {name} | {layer.alpha_min} | {alpha} | "
          f"{', '.join(f'{g:.2g}' for g in np.asarray(slope))} |")


def decay_table():
  layer = FlashFFN(128, 4, 2, 128, rngs=nnx.Rngs(0))
  params = nnx.state(layer, nnx.Param)
  is_var = lambda x: isinstance(x, nnx.Variable)
  variables = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
  decayed = jax.tree.leaves(optim.decay_mask(params))
  print("\n## Weight decay on FlashFFN's parameters\n")
  print("| parameter | shape | decayed before (ndim >= 2) | decayed now |")
  print("|---|---|---|---|")
  for (path, v), now in zip(variables, decayed):
    print(f"| {jax.tree_util.keystr(path)} | {tuple(v.shape)} | {v.ndim >= 2} | {now} |")


def far_mass(q, k, coords, field_ids, block, radius, block_bias):
  """Mean over queries and heads of the softmax mass on far-cube summaries (dense, float32)."""
  cube = coords // jnp.asarray(block)
  same = field_ids[:, :, None] == field_ids[:, None, :]
  dist = jnp.max(jnp.abs(cube[:, :, None] - cube[:, None, :]), axis=-1)
  local, far = same & (dist <= radius), same & (dist > radius)
  same_cube = (same & (dist == 0)).astype(jnp.float32)
  n = same_cube.sum(-1)
  kbar = jnp.einsum("bjl,blhd->bjhd", same_cube, k) / n[:, :, None, None]
  scale = 1 / math.sqrt(q.shape[-1])
  s_loc = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  # each far token j stands for its cube: weight 1/n_c(j) per token, times n_c with the bias
  s_far = jnp.einsum("bihd,bjhd->bhij", q, kbar) * scale - jnp.log(n)[:, None, None, :]
  s_far = s_far + (jnp.log(n)[:, None, None, :] if block_bias else 0.0)
  e_loc = jnp.where(local[:, None], jnp.exp(s_loc), 0.0).sum(-1)
  e_far = jnp.where(far[:, None], jnp.exp(s_far), 0.0).sum(-1)
  share = e_far / (e_loc + e_far)                                      # [B, H, N]
  valid = jnp.broadcast_to((field_ids >= 0)[:, None], share.shape)
  return float(jnp.sum(jnp.where(valid, share, 0)) / jnp.sum(valid))


def pack3d_table():
  config = exp_seg3d_cpu.get_config()
  task = seg3d_task.build_task(config)
  batch = task.train_batch(0)
  model = task.model
  layer = model.blocks[0].mixer
  opts = config.model.attention_options
  tokens = jnp.asarray(batch["tokens"])
  coords, field_ids = jnp.asarray(batch["coords"]), jnp.asarray(batch["field_ids"])
  x = tokens @ model.embed[...] + model.embed_bias[...]
  x = model.blocks[0].norm1(x)
  d = x.shape[-1]
  qkv = (x @ layer.w_qkv[...].reshape(d, -1)).reshape(*x.shape[:2], 3, -1, layer.head_dim)
  q, k = (rope.axial_rope_3d(t, coords, **layer.rope) for t in (qkv[:, :, 0], qkv[:, :, 1]))
  real = jnp.where(jnp.asarray(batch["mask"]) > 0, field_ids, -1)     # padding: not counted
  print("\n## Pack3D: attention mass on far summaries at init (seg3d shapes, layer 1)\n")
  print("| far logit bias | share of attention mass on far summaries |")
  print("|---|---|")
  for name, bias in (("log(n_b) (default; + offset 0 at init)", True), ("none", False)):
    share = far_mass(q, k, coords, real, opts.block_shape, opts.radius_blocks, bias)
    print(f"| {name} | {share:.1%} |")


def main():
  flashffn_table()
  frac_table()
  decay_table()
  pack3d_table()


if __name__ == "__main__":
  main()
