"""Each Pallas kernel inside jax.shard_map on the 8 simulated CPU devices (tests/conftest.py):
batch split over 4 devices and heads over 2, forward and gradients equal to the unsharded
result (the op's plain reference, which the kernel tests hold the unsharded kernel to; it
compiles in a fraction of the kernel's time).

Pallas kernels cannot be auto-partitioned, so the models run them under shard_map
(models.partitioning.shard_layer); inputs replicated over a mesh axis (the FlashFFN tables
and FRAC modes over "batch") get their gradients summed over it by shard_map's transpose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from neurips26_jax.jaxops import flash_ffn as ffn_ops
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops import pack3d as pack3d_ops
from neurips26_jax.pallas_kernels import flash_ffn, frac_scan, pack3d_attention
from tests import kernel_checks
from tests.test_pack3d import packed

MESH = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("batch", "heads"))
TOKENS = P("batch", None, "heads")        # [B, L, H, ...]


def _loss(op, *args):
  out = op(*args)
  outs = out if isinstance(out, tuple) else (out,)
  return sum(jnp.sum(jnp.sin(o.astype(jnp.float32) + i)) for i, o in enumerate(outs))


def check_sharded(op, reference, args, in_specs, out_specs, argnums):
  """op (default dispatch: interpreted here) under shard_map equals the unsharded reference,
  forward and d/d(args[argnums])."""
  sharded = jax.shard_map(op, mesh=MESH, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)
  results = []
  for fn in (reference, sharded):
    grad = jax.grad(functools.partial(_loss, fn), argnums=argnums)
    results.append(jax.jit(lambda *a, fn=fn, grad=grad: (fn(*a), grad(*a)))(*args))
  (out, grads), (out_sh, grads_sh) = results
  for i, (a, b) in enumerate(zip(jax.tree.leaves(out_sh), jax.tree.leaves(out), strict=True)):
    kernel_checks.assert_close(a, b, rtol=1e-5, name=f"output {i}")
  for i, a, b in zip(argnums, grads_sh, grads, strict=True):
    kernel_checks.assert_close(a, b, rtol=1e-5, name=f"d arg {i}")


def test_flash_ffn_under_shard_map():
  b, l, h, d_h, e, d_e = 4, 19, 2, 8, 2, 16
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (b, l, h, d_h))
  r = jax.nn.softmax(jax.random.normal(ks[1], (b, l, h, e)), axis=-1)
  k, u, v = (0.3 * jax.random.normal(kk, (h, e, d_e, d_h)) for kk in ks[2:])
  tables = P("heads")
  check_sharded(flash_ffn.mhffn, ffn_ops.mhffn_reference, (q, r, k, u, v),
                (TOKENS, TOKENS, tables, tables, tables), TOKENS, argnums=(0, 1, 2, 3, 4))


def test_frac_scan_under_shard_map():
  b, l, h, p, n, m = 4, 21, 2, 8, 4, 3
  ks = jax.random.split(jax.random.key(1), 6)
  x = jax.random.normal(ks[0], (b, l, h, p))
  dt = jax.nn.softplus(jax.random.normal(ks[1], (b, l, h)))
  bb, c = 0.5 * jax.random.normal(ks[2], (2, b, l, h, n))
  rates = jnp.exp(jax.random.uniform(ks[3], (h, m), minval=-3.0, maxval=1.0))
  weights = jax.random.uniform(ks[4], (h, m), minval=0.1, maxval=1.0)
  state = jax.random.normal(ks[5], (b, h, m, n, p))
  op = functools.partial(frac_scan.frac_scan, chunk=8)
  check_sharded(op, frac_ops.frac_scan_reference, (x, dt, bb, c, rates, weights, state),
                (TOKENS, TOKENS, TOKENS, TOKENS, P("heads"), P("heads"), P("batch", "heads")),
                (TOKENS, P("batch", "heads")), argnums=tuple(range(7)))


def test_pack3d_under_shard_map():
  """coords and field_ids are split with the batch, so the kernel sees them traced and
  uses `max_cubes` slots (as in the models); four entries packing different fields."""
  coords, field_ids = packed(([(3, 4, 5)], [(2, 5, 6)], [(2, 3, 4), (3, 3, 4)], [(6, 5, 2)]))
  ks = jax.random.split(jax.random.key(2), 3)
  q, k, v = (jax.random.normal(kk, coords.shape[:2] + (2, 6)) for kk in ks)
  op = functools.partial(pack3d_attention.pack3d_attention, block_shape=(2, 2, 2),
                         max_cubes=16)
  reference = functools.partial(pack3d_ops.pack3d_attention_reference, block_shape=(2, 2, 2))
  check_sharded(op, reference, (q, k, v, jnp.asarray(coords), jnp.asarray(field_ids)),
                (TOKENS, TOKENS, TOKENS, P("batch"), P("batch")), TOKENS, argnums=(0, 1, 2))
  assert np.asarray(field_ids).max() == 1  # one entry packs two fields
