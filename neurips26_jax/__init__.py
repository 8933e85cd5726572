"""FlashFFN, Pack3D and FRAC for JAX: references, Pallas kernels (TPU/GPU), NNX layers, training.

The distribution is `neurips26-jax`; this is its one import name. Its subpackages are the
repository's top-level folders (the build maps `neurips26_jax.<folder>` onto `<folder>/`):

  neurips26_jax.jaxops          pure-functional references and XLA paths
  neurips26_jax.pallas_kernels  the Pallas kernels (Mosaic TPU, Mosaic GPU, Triton)
  neurips26_jax.models          Flax NNX layers and models
  neurips26_jax.train           the trainers (console scripts neurips26-train-lm, -seg3d)
  neurips26_jax.configs         the experiment configs, named by --config=<name>

  >>> from neurips26_jax import FlashFFN, FRACMixer, LanguageModel, Pack3DAttention

The layers are imported on first use, so `import neurips26_jax` stays cheap. DESIGN.md, the
math and rules that docstrings cite by section ("DESIGN.md section 4"), ships beside this file.
"""

import importlib
import importlib.metadata
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from neurips26_jax.models import (Block, CausalAttention, FlashFFN, FRACMixer, LanguageModel,
                                    Pack3DAttention, Pack3DSegmenter, RMSNorm, SwiGLU, UNet3D)

_CLONE = pathlib.Path(__file__).resolve().parents[1]
if (_CLONE / "pyproject.toml").is_file() and (_CLONE / "pallas_kernels").is_dir():
  # A clone used without installing it (PYTHONPATH=<clone>, as benchmarks/gpu_check.sh on a
  # machine that has only its own jax) finds the subpackages where the build maps them from.
  __path__.append(str(_CLONE))

try:
  __version__: str = importlib.metadata.version("neurips26-jax")
except importlib.metadata.PackageNotFoundError:   # that uninstalled clone
  __version__ = "0+unknown"

_FROM_MODELS = ("Block", "CausalAttention", "FlashFFN", "FRACMixer", "LanguageModel",
                "Pack3DAttention", "Pack3DSegmenter", "RMSNorm", "SwiGLU", "UNet3D")

__all__ = ["__version__", *_FROM_MODELS]


def __getattr__(name: str):
  if name in _FROM_MODELS:
    return getattr(importlib.import_module("neurips26_jax.models"), name)
  raise AttributeError(f"module 'neurips26_jax' has no attribute {name!r}")
