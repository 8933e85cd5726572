"""Pack3DSegmenter, UNet3D and the 3D segmentation training binary; both models against their
formulas in float64 numpy (tests/layer_formula_checks.py), and their initialisation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from neurips26_jax.configs import seg3d_smoke
from neurips26_jax.models.seg3d import Pack3DSegmenter, voxel_logits
from neurips26_jax.models.unet3d import UNet3D, param_count, unet3d_matching
from neurips26_jax.train import seg3d_task, trainer
from neurips26_jax.train.data import volumes
from neurips26_jax.train.metrics import read_metrics
from tests.layer_formula_checks import (P, build, close, normal, pack3d_layer_numpy,
                                         randomize, rms_norm, run, silu, stats_match,
                                         swiglu_numpy, two_fields)


@functools.cache
def segmenter():
  return build(Pack3DSegmenter, num_classes=4, d_model=12, depth=1, num_heads=2,
               ffn_options={"d_ff": 24}, attention_options={"block_shape": (2, 2, 2)},
               impl="xla")


def test_segmenter_is_invariant_to_the_packing_order():
  fields = volumes.sample_fields(seed=0, stream=0, index=0, count=2, shapes=[(8, 8, 12)])
  b = volumes.pack(fields, items=1, patch=(4, 4, 4), num_tokens=32)    # 24 + 8 padding
  model = segmenter()
  args = (b["tokens"], b["coords"], b["field_ids"])
  logits = run(model, *args)
  assert logits.shape == (1, 32, 64, 4)
  perm = np.random.default_rng(0).permutation(32)
  shuffled = run(model, *(a[:, perm] for a in args))
  np.testing.assert_allclose(shuffled, logits[:, perm], atol=1e-5)
  vols = voxel_logits(logits[0], [(8, 8, 12)] * 2, (4, 4, 4))
  assert [v.shape for v in vols] == [(8, 8, 12, 4)] * 2
  # voxel_logits inverts the packing: label tokens -> label volumes
  labels = voxel_logits(jnp.asarray(b["labels"][0])[..., None], [(8, 8, 12)] * 2, (4, 4, 4))
  np.testing.assert_array_equal(labels[1][..., 0], fields[1][1])


def test_unet_shapes_and_size_matching():
  model = build(UNet3D, num_classes=4, base_channels=4, levels=2)
  assert run(model, jnp.ones((1, 8, 8, 12, 1))).shape == (1, 8, 8, 12, 4)
  with pytest.raises(ValueError, match="divisible"):
    model(jnp.ones((1, 7, 8, 8, 1)))
  target = param_count(segmenter())
  base = unet3d_matching(target, levels=2, num_classes=4)
  matched = param_count(nnx.eval_shape(lambda: UNet3D(num_classes=4, base_channels=base,
                                                      levels=2, rngs=nnx.Rngs(0))))
  assert abs(matched - target) / target < 0.25


def test_unet_training_reports_loss_and_dice(tmp_path):
  """(Pack3DSegmenter training runs in tests/test_cli.py and tests/test_inference.py.)"""
  c = seg3d_smoke.get_config()
  c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 2, 2, 2, 2
  c.mesh.data = 2
  c.model.kind = "unet3d"
  trainer.fit(c, tmp_path, seg3d_task.build_task(c))
  rows = read_metrics(tmp_path / "metrics.jsonl")
  assert np.isfinite(rows[-1]["eval_loss"]) and 0 <= rows[-1]["eval_dice"] <= 1


@pytest.mark.parametrize("field, value, message", [
    ("model.kind", "vit", "config.model.kind"),
    ("model.num_heads", 5, "config.model"),
    ("data.num_tokens", 8, "config.data")])
def test_bad_config_names_the_field(field, value, message):
  c = seg3d_smoke.get_config()
  section, leaf = field.split(".")
  c[section][leaf] = value
  with pytest.raises(ValueError, match=message):
    seg3d_task.build_task(c)


@pytest.mark.slow
def test_sharded_pallas_pack3d_equals_one_device(tmp_path):
  """Pack3D's Pallas kernel under shard_map (2x2x2 mesh) trains like one device (~1 min)."""
  runs = []
  for name, mesh in (("one", dict(data=1, fsdp=1, tensor=1)),
                     ("mesh", dict(data=2, fsdp=2, tensor=2))):
    c = seg3d_smoke.get_config()
    c.steps, c.eval_every, c.checkpoint_every, c.batch_size = 2, 2, 2, 4
    c.model.impl = "pallas"
    c.mesh.update(mesh)
    trainer.fit(c, tmp_path / name, seg3d_task.build_task(c))
    runs.append([r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl") if "loss" in r])
  np.testing.assert_allclose(runs[1], runs[0], rtol=2e-5)


# ----------------------------------------------------------------------------- formulas and init

def test_pack3d_segmenter_formula_and_init():
  """tokens -> linear patch embedding (+ bias) -> Block(Pack3DAttention, SwiGLU) -> RMSNorm
  -> head -> [B, N, p^3, K]."""
  coords, field_ids = two_fields(seed=1)
  patch, classes, d = (2, 2, 2), 3, 12
  model = build(Pack3DSegmenter, patch=patch, num_classes=classes, d_model=d, depth=1,
                num_heads=2, ffn_options={"d_ff": 16})
  randomize(model.embed_bias, 1, center=0.0)
  for i, norm in enumerate((model.norm, model.blocks[0].norm1, model.blocks[0].norm2)):
    randomize(norm.scale, 2 + i)
  tokens = normal(3, coords.shape[:2] + (8,))
  x = tokens @ P(model.embed) + P(model.embed_bias)
  block = model.blocks[0]
  x = x + pack3d_layer_numpy(block.mixer, rms_norm(x, P(block.norm1.scale)), coords, field_ids,
                             heads=2)
  x = x + swiglu_numpy(block.ffn, rms_norm(x, P(block.norm2.scale)))
  expected = (rms_norm(x, P(model.norm.scale)) @ P(model.head)).reshape(
      coords.shape[:2] + (8, classes))
  got = nnx.jit(lambda m, t: m(t, coords, field_ids))(model, jnp.asarray(tokens, jnp.float32))
  close(got, expected)
  fresh = build(Pack3DSegmenter, patch=(4, 4, 4), num_classes=4, d_model=24, depth=1,
                num_heads=2, ffn_options={"d_ff": 8})
  stats_match(fresh.embed[...], std=64 ** -0.5, name="embed")   # normal / sqrt(p^3 C)
  stats_match(fresh.head[...], std=24 ** -0.5, name="head")     # normal / sqrt(d)
  np.testing.assert_array_equal(fresh.embed_bias[...], np.zeros(24))


def conv3d_same(x, kernel, bias):
  """Cross-correlation with zero 'SAME' padding: x [B, Z, Y, X, C], kernel [kz, ky, kx, C, O]."""
  kz, ky, kx = kernel.shape[:3]
  pad = [(0, 0)] + [((k - 1) // 2, k // 2) for k in (kz, ky, kx)] + [(0, 0)]
  xp = np.pad(x, pad)
  z, y, w = x.shape[1:4]
  out = np.zeros(x.shape[:4] + (kernel.shape[-1],))
  for a in range(kz):
    for b in range(ky):
      for c in range(kx):
        out += xp[:, a:a + z, b:b + y, c:c + w] @ kernel[a, b, c]
  return out + bias


def up2(x, kernel, bias):
  """flax ConvTranspose, kernel 2, stride 2: each voxel becomes a 2x2x2 block, out[2i + a]
  = x[i] kernel[1 - a] (lax.conv_transpose without kernel transposition)."""
  bsz, z, y, w, _ = x.shape
  out = np.zeros((bsz, 2 * z, 2 * y, 2 * w, kernel.shape[-1]))
  for a in range(2):
    for b in range(2):
      for c in range(2):
        out[:, a::2, b::2, c::2] = x @ kernel[1 - a, 1 - b, 1 - c]
  return out + bias


def conv_block(block, x):
  for conv, norm in zip(block.convs, block.norms):
    x = silu(rms_norm(conv3d_same(x, P(conv.kernel), P(conv.bias)), P(norm.scale)))
  return x


def test_unet3d_formula():
  """models/unet3d.py's docstring: per level two (3^3 conv -> RMSNorm -> SiLU), 2^3 max-pool
  down, transposed conv up, concat [up, skip], two convs, 1^3 conv out."""
  model = build(UNet3D, in_channels=2, num_classes=3, base_channels=2, levels=2)
  for i, (_, p) in enumerate(nnx.iter_graph(model)):
    if isinstance(p, nnx.Param) and p[...].ndim == 1:       # biases and norm scales
      randomize(p, 30 + i, center=0.5)
  image = normal(1, (1, 4, 4, 6, 2))
  skip = conv_block(model.down[0], image)
  b, z, y, w, c = skip.shape
  pooled = skip.reshape(b, z // 2, 2, y // 2, 2, w // 2, 2, c).max(axis=(2, 4, 6))
  deep = conv_block(model.down[1], pooled)
  up = up2(deep, P(model.up[0].kernel), P(model.up[0].bias))
  x = conv_block(model.merge[0], np.concatenate([up, skip], -1))
  expected = conv3d_same(x, P(model.out.kernel), P(model.out.bias))
  out = run(model, image.astype(np.float32))
  assert out.dtype == jnp.float32
  close(out, expected)
  assert [blk.convs[0].kernel.shape[-1] for blk in model.down] == [2, 4]  # base * 2^level
