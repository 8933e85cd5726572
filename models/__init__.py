"""Flax NNX layers and models built from `jaxops` and `pallas_kernels`."""

from models.flash_ffn import FlashFFN, SwiGLU, default_d_expert, flashffn_matching_swiglu

__all__ = ["FlashFFN", "SwiGLU", "default_d_expert", "flashffn_matching_swiglu"]
