"""A one-minute FlashFFN demo (the `make demo` job until the training binaries land).

Checks the Pallas kernel against the reference on random inputs, then trains a FlashFFN
layer (Pallas kernel, interpreted on CPU) and a SwiGLU of the same parameter count to
imitate a random teacher network, printing the losses as they fall.

  python -m train.flash_ffn_demo --steps=150
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

from jaxops import flash_ffn as ops
from models import FlashFFN, SwiGLU, flashffn_matching_swiglu
from pallas_kernels import flash_ffn as kernel

_STEPS = flags.DEFINE_integer("steps", 150, "Training steps per layer.")
D, HEADS, D_FF, D_E, TOKENS = 64, 4, 192, 32, 256


def check_kernel():
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (2, 77, HEADS, 16))
  r = jax.nn.softmax(jax.random.normal(ks[1], (2, 77, HEADS, 3)))
  k, u, v = (0.3 * jax.random.normal(kk, (HEADS, 3, 32, 16)) for kk in ks[2:])
  err = jnp.max(jnp.abs(kernel.mhffn(q, r, k, u, v) - ops.mhffn_reference(q, r, k, u, v)))
  print(f"Pallas kernel vs reference, B=2 L=77 H=4 E=3: max |error| = {float(err):.2e}")


def train(name, layer, teacher, steps):
  optimizer = nnx.Optimizer(layer, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(layer, optimizer, x):
    loss_fn = lambda layer: jnp.mean((layer(x) - teacher(x)) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(layer)
    optimizer.update(layer, grads)
    return loss

  start = time.perf_counter()
  for i in range(steps):
    x = jax.random.normal(jax.random.key(i), (4, TOKENS, D))
    loss = step(layer, optimizer, x)
    if i % max(1, steps // 5) == 0 or i == steps - 1:
      print(f"  {name:8s} step {i:4d}  loss {float(loss):.5f}  ({time.perf_counter() - start:.0f} s)",
            flush=True)
  return float(loss)


def main(_):
  check_kernel()
  shape = flashffn_matching_swiglu(D, D_FF, d_expert=D_E)
  teacher = SwiGLU(D, 4 * D, rngs=nnx.Rngs(99))
  print(f"Fitting a random SwiGLU teacher: FlashFFN (H={HEADS}, E={shape['num_experts']}, "
        f"d_e={D_E}) vs SwiGLU (d_ff={D_FF}), {_STEPS.value} steps each")
  flash = train("FlashFFN", FlashFFN(D, HEADS, **shape, rngs=nnx.Rngs(0)), teacher, _STEPS.value)
  swiglu = train("SwiGLU", SwiGLU(D, D_FF, rngs=nnx.Rngs(0)), teacher, _STEPS.value)
  print(f"final loss: FlashFFN {flash:.5f}, SwiGLU {swiglu:.5f}")


if __name__ == "__main__":
  app.run(main)
