"""Activation memory and CPU time of one FFN layer's forward+backward.

Shape: the paper's 370M config, d=1024, H=8 (d_h=128), E=11, d_e=256, against a SwiGLU
of width 2752, batch 1. Memory is XLA's compiled temp_size_in_bytes of the layer's
forward plus its vjp (gradients of x and all params) for a given upstream gradient dy,
as inside a model; float32 unless --dtype says otherwise. The Pallas kernel is measured
through its
CPU interpreters. The TPU interpreter (`pltpu.InterpretParams`) keeps the kernel's
blocks outside XLA, as VMEM is outside HBM, so XLA's temp counts exactly the buffers the
program around the kernel allocates: the number that carries to hardware. The default
CPU interpreter (`interpret=True`) discharges the kernel into an XLA while loop whose
carries copy every operand; it is shown too, as an upper bound.

  python -m benchmarks.flash_ffn_memory --lengths=2048,8192,16384,32768 --time_lengths=2048,8192
  python -m benchmarks.flash_ffn_memory --dtype=bfloat16 --time_lengths=
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from benchmarks.common import mib, temp_bytes, wall_seconds
from neurips26_jax.models import FlashFFN, SwiGLU

_LENGTHS = flags.DEFINE_list("lengths", ["2048", "8192", "16384", "32768"], "Sequence lengths.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "Compute dtype of the layers (parameters stay float32).")
_TIME_LENGTHS = flags.DEFINE_list("time_lengths", ["2048", "8192"],
                                  "Lengths at which to time the XLA paths (CPU).")
D, HEADS, EXPERTS, D_E, D_FF_SWIGLU = 1024, 8, 11, 256, 2752


def layers():
  """name -> (layer, remat): the six variants, built once."""
  rngs = lambda: nnx.Rngs(0)
  dtype = jnp.dtype(_DTYPE.value)
  flash = lambda impl, **kw: FlashFFN(D, HEADS, EXPERTS, D_E, impl=impl, dtype=dtype,
                                      rngs=rngs(), **kw)
  return {
      "SwiGLU (unfused)": (SwiGLU(D, D_FF_SWIGLU, dtype=dtype, rngs=rngs()), False),
      "SwiGLU + jax.checkpoint": (SwiGLU(D, D_FF_SWIGLU, dtype=dtype, rngs=rngs()), True),
      "naive multi-head FFN": (flash("reference"), False),
      "FlashFFN XLA path": (flash("xla"), False),
      "FlashFFN Pallas kernel (TPU interpreter)": (
          flash("pallas", interpret=pltpu.InterpretParams()), False),
      "FlashFFN Pallas kernel (interpret=True)": (flash("pallas", interpret=True), False),
  }


def fwd_bwd(layer, remat: bool):
  """(params, x, dy) -> (dparams, dx): the layer's forward and backward inside a model,
  with the upstream gradient dy given (an argument, so it is not counted as temp)."""
  graphdef, params = nnx.split(layer)
  call = lambda p, x: nnx.merge(graphdef, p)(x)
  if remat:
    call = jax.checkpoint(call)

  def step(params, x, dy):
    return jax.vjp(call, params, x)[1](dy)

  return step, params


def main(_):
  variants = layers()
  lengths = [int(x) for x in _LENGTHS.value]
  time_lengths = {int(x) for x in _TIME_LENGTHS.value}
  print(f"| variant | " + " | ".join(f"L={n} MiB" for n in lengths) + " |")
  print("|---|" + "---|" * len(lengths))
  memory = {}
  for name, (layer, remat) in variants.items():
    fn, params = fwd_bwd(layer, remat)
    row = []
    for n in lengths:
      x = jax.ShapeDtypeStruct((1, n, D), _DTYPE.value)
      memory[name, n] = temp_bytes(fn, params, x, x)
      row.append(mib(memory[name, n]))
    print(f"| {name} | " + " | ".join(row) + " |", flush=True)
  base = "SwiGLU (unfused)"
  print("\nratio unfused SwiGLU / variant:")
  for name in variants:
    print(f"| {name} | " + " | ".join(f"{memory[base, n] / memory[name, n]:.1f}x"
                                       for n in lengths) + " |")
  print("\nCPU wall time of forward+backward (best of 3):")
  for n in sorted(time_lengths):
    x = jax.random.normal(jax.random.key(0), (1, n, D), _DTYPE.value)
    for name, (layer, remat) in variants.items():
      if name.startswith("FlashFFN Pallas kernel"):
        continue  # the interpreter's time says nothing about the kernel
      fn, params = fwd_bwd(layer, remat)
      print(f"| L={n} | {name} | {wall_seconds(fn, params, x, x):.2f} s |", flush=True)


if __name__ == "__main__":
  app.run(main)
