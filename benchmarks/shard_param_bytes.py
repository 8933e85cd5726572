"""Parameter bytes one device holds inside shard_map for the Pallas layers, tensor = 2.

  python -m benchmarks.shard_param_bytes

Under a mesh the kernel layers run inside jax.shard_map (models.partitioning.shard_layer), where
each parameter, once gathered, is split over "tensor" along its head dimensions (HEAD_AXES) and
whole otherwise. Shapes only (nnx.eval_shape of the lm_default and seg3d_cells models); "whole" is
what a device would hold if the layer's parameters entered replicated.
"""

from __future__ import annotations

import math

from flax import nnx

from neurips26_jax.configs import lm_default, seg3d_cells
from neurips26_jax.models import FlashFFN, FRACMixer, LanguageModel, Pack3DAttention
from neurips26_jax.models.partitioning import HEAD_AXES, logical_axes
from neurips26_jax.train import seg3d_task

TENSOR = 2


def inside_bytes(layer: nnx.Module, tensor: int) -> int:
  total = 0
  for _, v in nnx.iter_graph(layer):
    if isinstance(v, nnx.Param):
      split = tensor if any(n in HEAD_AXES for n in logical_axes(v)) else 1
      value = v.get_value()
      total += math.prod(value.shape) * value.dtype.itemsize // split
  return total


def models() -> dict[str, nnx.Module]:
  lm = lm_default.get_config().model.to_dict()
  return {
      "lm_default": nnx.eval_shape(lambda: LanguageModel(**{**lm, "impl": "xla"},
                                                         rngs=nnx.Rngs(0))),
      # the trainer's own builder (seg3d_task._pack3d), shapes only
      "seg3d_cells": nnx.eval_shape(lambda: seg3d_task._pack3d(seg3d_cells.get_config(),
                                                               None)),
  }


def main():
  print(f"| model | layer | count | bytes per device, whole | split over tensor={TENSOR} | ratio |")
  print("|---|---|---|---|---|---|")
  for name, model in models().items():
    for cls in (FRACMixer, Pack3DAttention, FlashFFN):
      layers = [v for _, v in nnx.iter_graph(model) if isinstance(v, cls)]
      if layers:
        whole = sum(inside_bytes(layer, 1) for layer in layers)
        split = sum(inside_bytes(layer, TENSOR) for layer in layers)
        print(f"| {name} | {cls.__name__} | {len(layers)} | {whole:,} | {split:,} |"
              f" {whole / split:.2f}x |")


if __name__ == "__main__":
  main()
