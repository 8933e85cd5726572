"""The suite's warning policy (pyproject.toml, [tool.pytest.ini_options] filterwarnings): a
DeprecationWarning from our packages or from JAX fails the test, except JAX's notice that the
Pallas Triton backend is deprecated; other libraries' own deprecations are left alone."""

import warnings

import pytest

TRITON = ("The Pallas Triton backend is deprecated and will be removed in a future JAX "
          "version. To keep using Pallas on GPU, please migrate to the Mosaic GPU backend.")


def _warn(message: str, module: str) -> None:
  warnings.warn_explicit(message, DeprecationWarning, f"{module}.py", 1, module=module)


@pytest.mark.parametrize("module", ["neurips26_jax.jaxops.frac",
                                    "neurips26_jax.pallas_kernels.flash_ffn.triton",
                                    "neurips26_jax.models", "neurips26_jax.train.trainer",
                                    "neurips26_jax.configs.lm_default", "neurips26_jax",
                                    "experiments.common", "benchmarks.aot.worker",
                                    "tests.kernel_checks", "jax._src.pallas.pallas_call"])
def test_deprecation_from_our_code_or_jax_fails(module):
  with pytest.raises(DeprecationWarning, match="old API"):
    _warn("old API", module)


def test_triton_backend_deprecation_is_the_one_exception():
  _warn(TRITON, "jax._src.pallas.pallas_call")


@pytest.mark.parametrize("module", ["flax.nnx.module", "importlib._bootstrap", "models",
                                    "neurips26_jaxx"])
def test_other_modules_deprecations_do_not_fail(module):
  with warnings.catch_warnings(record=True):
    _warn("old API", module)
