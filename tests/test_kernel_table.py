"""README's "which kernel body runs" table is what the dispatch code lowers to."""

import pytest

from neurips26_jax.pallas_kernels.dispatch import mosaic_gpu_available
from tools import kernel_table


@pytest.mark.skipif(not mosaic_gpu_available(), reason="the table is JAX >= 0.11.2's")
def test_readme_kernel_table_matches_the_lowered_programs():
  assert kernel_table.readme_table() == kernel_table.table(), (
      "README's kernel table is stale: python -m tools.kernel_table --readme")
