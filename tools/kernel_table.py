"""Which kernel body `impl="pallas"` (and "auto" where kernels compile) runs, per op, chip and
dtype, read from the lowered programs themselves: each op's forward at a default shape is
lowered from CPU for each target (`jax.export`) and the custom call in the module names the
body: Mosaic (TPU), Mosaic GPU, Triton, or none (XLA).

  python -m tools.kernel_table             # the markdown table
  python -m tools.kernel_table --readme    # written into README.md between its markers

tests/test_kernel_table.py fails when README's table and this one differ (JAX >= 0.11.2,
where Mosaic GPU is available; on older JAX every GPU row is Triton).
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from neurips26_jax.jaxops import packing
from neurips26_jax.models.impl import BODY_CALLS
from neurips26_jax.pallas_kernels import flash_ffn, frac_scan, pack3d_attention
from tests import kernel_checks
from tools.readme_section import replace_section

# (row label, export platform, GPU device kind)
TARGETS = [("TPU", "tpu", None),
           ("Hopper GPU (H100, H200)", "cuda", kernel_checks.HOPPER_DEVICE_KIND),
           ("Blackwell GPU (B200)", "cuda", kernel_checks.BLACKWELL_DEVICE_KIND),
           ("other CUDA GPU (A100)", "cuda", kernel_checks.CUDA_DEVICE_KIND)]
DTYPES = (jnp.bfloat16, jnp.float32)


def _flash_ffn(dtype):
  spec = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  table = spec(2, 2, 64, 64)
  return flash_ffn.mhffn, (spec(1, 128, 2, 64), spec(1, 128, 2, 2, d=jnp.float32), table,
                           table, table)


def _frac_scan(dtype):
  spec = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  return (lambda *a: frac_scan.frac_scan(*a)[0]), (
      spec(1, 128, 4, 64), spec(1, 128, 4, d=jnp.float32), spec(1, 128, 4, 16),
      spec(1, 128, 4, 16), spec(4, 16, d=jnp.float32), spec(4, 16, d=jnp.float32))


def _pack3d(dtype):
  coords = packing.grid_coords((8, 8, 8))[None]                 # 8 cubes of 4^3 tokens
  fields = np.zeros(coords.shape[:2], np.int32)
  spec = jax.ShapeDtypeStruct((1, coords.shape[1], 2, 48), dtype)
  return (lambda q, k, v: pack3d_attention.pack3d_attention(q, k, v, coords, fields)), \
      (spec, spec, spec)


# (op, the shape it is read at, its inputs)
OPS = [("FlashFFN", "d_h = 64", _flash_ffn),
       ("FRAC", "the default chunk", _frac_scan),
       ("Pack3D", "cubes of 4^3 tokens", _pack3d)]


def body(op_inputs, dtype, platform: str, device_kind: str | None) -> str:
  """The kernel body the op lowers to for one target, from its module's custom calls."""
  fn, args = op_inputs(dtype)
  text = (kernel_checks.export_mlir(fn, platform, *args, device_kind=device_kind)
          if device_kind else kernel_checks.export_mlir(fn, platform, *args))
  return " + ".join(name for name, call in BODY_CALLS.items() if call in text) or "XLA"


def table() -> str:
  lines = ["| op (read at) | chip | bfloat16 | float32 |", "|---|---|---|---|"]
  for name, shape, op_inputs in OPS:
    for label, platform, device_kind in TARGETS:
      cells = [body(op_inputs, dtype, platform, device_kind) for dtype in DTYPES]
      lines.append(f"| {name} ({shape}) | {label} | {cells[0]} | {cells[1]} |")
  return "\n".join(lines)


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- kernel-table:begin -->", "<!-- kernel-table:end -->"


def readme_table() -> str:
  """The table README.md holds between its markers."""
  return README.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
  jax.config.update("jax_platforms", "cpu")
  text = table()
  print(text)
  if "--readme" in sys.argv[1:]:
    replace_section(README, BEGIN, END, text)
