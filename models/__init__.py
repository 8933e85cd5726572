"""Flax NNX layers and models built from `jaxops` and `pallas_kernels`."""

from models.flash_ffn import FlashFFN, SwiGLU, default_d_expert, flashffn_matching_swiglu
from models.frac import FRACMixer
from models.pack3d import Pack3DAttention

__all__ = ["FRACMixer", "FlashFFN", "Pack3DAttention", "SwiGLU", "default_d_expert",
           "flashffn_matching_swiglu"]
