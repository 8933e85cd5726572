"""`mhffn_routed`: FlashFFN's head norm (with its gain), router and mixture from W_in's output,
with the norm, router and gain fold inside the Mosaic kernels (and in XLA around the GPU
kernels), against the float32 einsum reference `jaxops.flash_ffn.mhffn_routed_reference`;
what its backward keeps.

With the head norm the tables come as the layer stores them (float32, whatever q's dtype) with
a gain; without it, in q's dtype with no gain: both forms the op takes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from neurips26_jax.jaxops import flash_ffn as ops
from neurips26_jax.pallas_kernels import flash_ffn as kernel
from neurips26_jax.pallas_kernels.flash_ffn import tiles
from tests import kernel_checks

# Odd L, 3 experts (the router's lanes padded to 128), d_e in a full and a partial tile.
SHAPE = (2, 77, 2, 16, 3, 24)
BODIES = {
    "mosaic": dict(block_q=128, block_inter=16, block_q_dkv=128),
    "triton": dict(block_q=32, block_inter=16, block_q_dkv=64),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_inputs(dtype, shape=SHAPE, seed=0, gain=True):
  """(q, w_r, k, u, v[, gain]): with a gain the tables are float32 (the layer's parameters),
  without one in q's dtype."""
  b, l, h, d_h, e, d_e = shape
  # numpy draws: each jax.random call would compile a program per shape
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.standard_normal(s, np.float32)
  q = 2.0 * normal(b, l, h, d_h)     # not unit RMS: the norm matters
  w_r = normal(h, d_h, e)
  tables = [0.3 * normal(h, e, d_e, d_h) for _ in range(3)]
  g = 1.0 + 0.5 * normal(h, d_h)
  args = ((q.astype(dtype), w_r, *(t.astype(dtype) for t in tables)) if not gain
          else (q.astype(dtype), w_r, *tables, g))
  return tuple(jax.device_put(a) for a in args)


def _with_gain(op):
  return lambda q, w_r, k, u, v, *gain: op(q, w_r, k, u, v, gain=gain[0] if gain else None)


@functools.lru_cache(maxsize=None)
def compiled(path: str, normalize: bool, blocks: tuple = (), num_args: int = 6):
  """jit of the op's output and the gradients of every input (sin loss)."""
  if path == "reference":
    op = functools.partial(ops.mhffn_routed_reference, normalize=normalize)
  else:
    op = functools.partial(kernel.mhffn_routed, normalize=normalize, interpret=True,
                           backend=path, **dict(blocks or BODIES[path].items()))
  op = _with_gain(op)
  grad = jax.grad(functools.partial(kernel_checks.sin_loss, op), argnums=tuple(range(num_args)))
  return jax.jit(lambda *a: (op(*a), grad(*a)))


def check(path, dtype, normalize, shape=SHAPE, blocks=(), rtol=None):
  args = make_inputs(dtype, shape, gain=normalize)
  out_ref, grads_ref = compiled("reference", normalize, (), len(args))(
      *(a.astype(jnp.float32) for a in args))
  out, grads = compiled(path, normalize, blocks, len(args))(*args)
  assert out.dtype == dtype and out.shape == args[0].shape
  assert [g.dtype for g in grads] == [a.dtype for a in args]
  rtol = rtol or TOL[dtype]
  kernel_checks.assert_close(out, out_ref, rtol=rtol, name="o")
  kernel_checks.assert_grads_close(grads, grads_ref, args,
                                   ("q", "w_r", "k", "u", "v", "gain")[:len(args)],
                                   rtol=rtol * (4 if dtype == jnp.bfloat16 else 1))


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", ["mosaic", "triton"])
def test_matches_reference_forward_and_gradients(path, dtype, normalize):
  """Mosaic routes and folds the gain inside its kernels; Triton (like any GPU body) runs
  route_heads and `fold_gain` in XLA."""
  check(path, dtype, normalize)


def test_transposed_gradient_layout():
  """d_h and block_inter multiples of 128: dW_r accumulates as q_hat^T dz with the transposed
  table gradients."""
  # 128-wide heads: sums of 128 products; every path (Triton's too) is ~5e-5 off in dq here.
  check("mosaic", jnp.float32, True, shape=(1, 40, 2, 128, 3, 128),
        blocks=(("block_inter", 128), ("block_q", 128), ("block_q_dkv", 128)), rtol=1e-4)


def test_expert_groups_route_in_xla(monkeypatch):
  """Tables over the VMEM budget (expert groups): the router's sum spans every expert, so the
  norm and router run in XLA around the grouped kernels; still exact. One d_e tile per
  expert: the grouping is by experts."""
  monkeypatch.setattr(tiles, "mosaic_vmem_limit", lambda: 1)
  shape = (1, 150, 2, 16, 9, 8)
  q, _, k, *_ = make_inputs(jnp.float32, shape)
  plan = tiles.TilePlan.make("mosaic", kernel.BlockSizes(block_inter=8), q, k)
  assert plan.groups == 2
  check("mosaic", jnp.float32, True, shape=shape, blocks=(("block_inter", 8),))


def test_backward_keeps_only_the_inputs():
  """Of the residuals of the op's VJP, the only token-sized one is q and the only table-sized
  ones are the three tables as given: q_hat, the router weights and the folded, cast tables
  are recomputed, never kept from the forward (the layer's memory depends on it). The rest
  are [H, d_h, ...] router and gain arrays."""
  args = make_inputs(jnp.bfloat16)
  op = _with_gain(functools.partial(kernel.mhffn_routed, interpret=True, backend="mosaic",
                                    **BODIES["mosaic"]))
  q, w_r, k = args[:3]
  big = sorted((x.shape, str(x.dtype)) for x in kernel_checks.vjp_residuals(op, *args)
               if math.prod(x.shape) > w_r.size)
  assert big == sorted([(q.shape, "bfloat16")] + [(k.shape, "float32")] * 3)


def test_bad_router_or_gain_shape_names_the_argument():
  q, w_r, k, u, v, gain = make_inputs(jnp.float32)
  with pytest.raises(ValueError, match="w_r"):
    kernel.mhffn_routed(q, w_r[:, :-1], k, u, v)
  with pytest.raises(ValueError, match=r"gain.*\[H=2, d_h=16\]"):
    kernel.mhffn_routed(q, w_r, k, u, v, gain=gain[:, :-1])
