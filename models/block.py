"""The pre-norm residual block shared by the models, and the FFN choice.

Block:  x = x + mixer(RMSNorm(x), *context);  x = x + ffn(RMSNorm(x)),  x [B, L, d].
`context` is whatever else the mixer reads (Pack3D: coords, field_ids). Layers that call a
Pallas kernel (their resolved `impl` is "pallas") run through `partitioning.shard_layer`
(batch-split shard_map under a mesh) on their local heads (split over the tensor axis); a
token-wise FFN whose heads the tensor axis does not divide on a sequence split instead.
"""

from __future__ import annotations

from flax import nnx

from models.flash_ffn import FlashFFN, SwiGLU
from models.norm import RMSNorm
from models.partitioning import constrain, shard_layer

FFNS = ("swiglu", "flashffn")


def make_ffn(kind: str, d_model: int, num_heads: int, *, impl: str, interpret, dtype,
             options: dict, rngs: nnx.Rngs) -> nnx.Module:
  """The FFN `kind` (one of FFNS): SwiGLU(d_model, **options) or FlashFFN(d_model, **options)
  (FlashFFN defaults: num_heads, impl, interpret)."""
  if kind == "swiglu":
    return SwiGLU(d_model, dtype=dtype, rngs=rngs, **options)
  return FlashFFN(d_model, **{"num_heads": num_heads, "impl": impl, "interpret": interpret,
                              **options}, dtype=dtype, rngs=rngs)


def _uses_kernel(layer: nnx.Module) -> bool:
  return getattr(layer, "impl", None) == "pallas"


class Block(nnx.Module):
  """x [B, L, d] -> x + mixer(norm(x), *context), then + ffn(norm(.)); see the module
  docstring. Calls a mixer or FFN whose `impl` is "pallas" through `shard_layer`."""

  def __init__(self, mixer: nnx.Module, ffn: nnx.Module, d_model: int):
    self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
    self.mixer, self.ffn = mixer, ffn
    self.pallas_mixer, self.pallas_ffn = _uses_kernel(mixer), _uses_kernel(ffn)

  def __call__(self, x, *context):
    """x [B, L, d], context: the mixer's extra inputs ([B, ...] each) -> [B, L, d]."""
    h = self.norm1(x)
    x = x + (shard_layer(self.mixer, h, *context, split_heads=True) if self.pallas_mixer
             else self.mixer(h, *context))
    h = self.norm2(x)
    x = x + (shard_layer(self.ffn, h, split_seq=True, split_heads=True) if self.pallas_ffn
             else self.ffn(h))
    return constrain(x, ("batch", "seq", None))

  def step(self, x_t, cache):
    """Decoding (causal mixers): x_t [B, d] -> (y_t [B, d], cache)."""
    h, cache = self.mixer.step(self.norm1(x_t), cache)
    x_t = x_t + h.astype(x_t.dtype)
    return x_t + self.ffn(self.norm2(x_t)[:, None])[:, 0], cache
