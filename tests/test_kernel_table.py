"""README's "which kernel body runs" table is what the dispatch code lowers to."""

import jax.numpy as jnp
import pytest
from flax import nnx

from neurips26_jax.models import FlashFFN
from neurips26_jax.models.impl import AMPERE_DEVICE_KIND, kernel_body
from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available
from tools import kernel_table


@pytest.mark.skipif(not mosaic_gpu_available(), reason="the table is JAX >= 0.11.2's")
def test_readme_kernel_table_matches_the_lowered_programs():
  assert kernel_table.readme_table() == kernel_table.table(), (
      "README's kernel table is stale: python -m tools.kernel_table --readme")


def test_kernel_body_answers_for_other_chips_from_this_machine():
  """`kernel_body(layer, x, platform=...)` lowers for that chip from a CPU, as the table does:
  a layer built with impl="pallas" runs the Mosaic TPU body on a TPU and Triton on an A100."""
  layer = FlashFFN(128, impl="pallas", rngs=nnx.Rngs(0))
  x = jnp.ones((1, 16, 128), jnp.bfloat16)
  assert kernel_body(layer, x) == "XLA"                       # interpreted on this CPU
  assert kernel_body(layer, x, platform="tpu") == "Mosaic TPU"
  assert kernel_body(layer, x, platform="cuda", device_kind=AMPERE_DEVICE_KIND) == "Triton"
