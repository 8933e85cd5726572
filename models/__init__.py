"""Flax NNX layers and models built from `jaxops` and `pallas_kernels`.

Layers with a Pallas kernel (FlashFFN, FRACMixer, Pack3DAttention, and the models built from
them) take `impl` ("auto" by default; see `models.impl`) and `interpret`.
"""

from neurips26_jax.models.attention import CausalAttention
from neurips26_jax.models.block import Block
from neurips26_jax.models.flash_ffn import FlashFFN, SwiGLU, default_d_expert
from neurips26_jax.models.frac import FRACMixer
from neurips26_jax.models.impl import IMPLS, Impl
from neurips26_jax.models.lm import LanguageModel
from neurips26_jax.models.norm import RMSNorm
from neurips26_jax.models.pack3d import Pack3DAttention
from neurips26_jax.models.seg3d import Pack3DSegmenter, voxel_logits
from neurips26_jax.models.unet3d import UNet3D, unet3d_matching

__all__ = ["IMPLS", "Block", "CausalAttention", "FRACMixer", "FlashFFN", "Impl", "LanguageModel",
           "Pack3DAttention", "Pack3DSegmenter", "RMSNorm", "SwiGLU", "UNet3D",
           "default_d_expert", "unet3d_matching", "voxel_logits"]
