"""Flax NNX layers and models built from `jaxops` and `pallas_kernels`.

Layers with a Pallas kernel (FlashFFN, FRACMixer, Pack3DAttention, and the models built from
them) take `impl` ("auto" by default; see `models.impl`) and `interpret`.
"""

from models.attention import CausalAttention
from models.block import Block
from models.flash_ffn import FlashFFN, SwiGLU, default_d_expert
from models.frac import FRACMixer
from models.impl import IMPLS, Impl
from models.lm import LanguageModel
from models.norm import RMSNorm
from models.pack3d import Pack3DAttention
from models.seg3d import Pack3DSegmenter, voxel_logits
from models.unet3d import UNet3D, unet3d_matching

__all__ = ["IMPLS", "Block", "CausalAttention", "FRACMixer", "FlashFFN", "Impl", "LanguageModel",
           "Pack3DAttention", "Pack3DSegmenter", "RMSNorm", "SwiGLU", "UNet3D",
           "default_d_expert", "unet3d_matching", "voxel_logits"]
