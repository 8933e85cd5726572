"""The pre-norm residual block shared by the models, and the FFN choice.

Block:  x = x + mixer(RMSNorm(x), *context);  x = x + ffn(RMSNorm(x)),  x [B, L, d].
`context` is whatever else the mixer reads (Pack3D: coords, field_ids). Layers that call a
Pallas kernel (their resolved `impl` is "pallas") run through `partitioning.shard_layer`
(batch-split shard_map under a mesh) on their local heads (split over the tensor axis); a
token-wise FFN whose heads the tensor axis does not divide on a sequence split instead.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx
from jax.typing import DTypeLike

from neurips26_jax.jaxops import checks
from neurips26_jax.models.flash_ffn import FlashFFN, SwiGLU, flashffn_shape
from neurips26_jax.models.norm import RMSNorm
from neurips26_jax.models.partitioning import constrain, shard_layer

FFNS = ("swiglu", "flashffn")


def param_count(layer: nnx.Module) -> int:
  """The number of parameters of `layer` (also of an abstract one from nnx.eval_shape)."""
  return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def make_ffn(kind: str, d_model: int, *, params: int | None = None, impl: str, interpret: Any,
             dtype: DTypeLike | None, options: dict[str, Any], rngs: nnx.Rngs,
             owner: str = "LanguageModel") -> nnx.Module:
  """The FFN `kind` (one of FFNS) of about `params` parameters (None: a SwiGLU of its default
  width's), unless `options` set its sizes: SwiGLU(d_model, **options) or
  FlashFFN(d_model, **options) (FlashFFN defaults: impl, interpret)."""
  checks.options(owner, "ffn_options", options, SwiGLU if kind == "swiglu" else FlashFFN,
                 taken=("d_model", "dtype"))
  d_ff = None if params is None else max(8, 8 * round(params / (3 * d_model) / 8))
  if kind == "swiglu":
    return SwiGLU(d_model, **{"d_ff": d_ff, **options}, dtype=dtype, rngs=rngs)
  if params is not None and not {"num_experts", "d_expert"} & set(options):
    options = {**flashffn_shape(d_model, params, head_norm=options.get("head_norm", True)),
               **options}
  return FlashFFN(d_model, **{"impl": impl, "interpret": interpret, **options}, dtype=dtype,
                  rngs=rngs)


def _uses_kernel(layer: nnx.Module) -> bool:
  return getattr(layer, "impl", None) == "pallas"


class Block(nnx.Module):
  """x [B, L, d] -> x + mixer(norm(x), *context), then + ffn(norm(.)); see the module
  docstring. Calls a mixer or FFN whose `impl` is "pallas" through `shard_layer`."""

  def __init__(self, mixer: nnx.Module, ffn: nnx.Module, d_model: int) -> None:
    self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
    self.mixer, self.ffn = mixer, ffn
    self.pallas_mixer, self.pallas_ffn = _uses_kernel(mixer), _uses_kernel(ffn)

  def __call__(self, x: jax.Array, *context: jax.Array) -> jax.Array:
    """x [B, L, d], context: the mixer's extra inputs ([B, ...] each) -> [B, L, d]."""
    h = self.norm1(x)
    x = x + (shard_layer(self.mixer, h, *context, split_heads=True) if self.pallas_mixer
             else self.mixer(h, *context))
    h = self.norm2(x)
    x = x + (shard_layer(self.ffn, h, split_seq=True, split_heads=True) if self.pallas_ffn
             else self.ffn(h))
    return constrain(x, ("batch", "seq", None))

  def step(self, x_t: jax.Array,
           cache: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoding (causal mixers): x_t [B, d] -> (y_t [B, d], cache)."""
    h, cache = self.mixer.step(self.norm1(x_t), cache)
    x_t = x_t + h.astype(x_t.dtype)
    return x_t + self.ffn(self.norm2(x_t)[:, None])[:, 0], cache
