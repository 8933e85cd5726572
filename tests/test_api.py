"""One API: every layer and model exported from `models`, one `impl`
vocabulary whose default "auto" resolves per platform, `interpret` on every kernel layer,
shapes in every public docstring."""

from __future__ import annotations

import inspect

import pytest
from flax import nnx

from neurips26_jax import models
from neurips26_jax.models import impl as impl_module

KERNEL_LAYERS = ("FlashFFN", "FRACMixer", "Pack3DAttention", "LanguageModel", "Pack3DSegmenter")
LAYERS = KERNEL_LAYERS + ("SwiGLU", "CausalAttention", "RMSNorm", "Block", "UNet3D")

BUILD = {
    "FlashFFN": lambda **kw: models.FlashFFN(32, 2, 2, 8, **kw),
    "FRACMixer": lambda **kw: models.FRACMixer(16, num_heads=2, head_dim=8, state_dim=4,
                                               context=16, **kw),
    "Pack3DAttention": lambda **kw: models.Pack3DAttention(12, 2, **kw),
    "LanguageModel": lambda **kw: models.LanguageModel(
        d_model=16, num_layers=1, num_heads=2, context=8, mixer="frac", ffn="flashffn",
        mixer_options={"head_dim": 8, "state_dim": 4},
        ffn_options={"num_experts": 2, "d_expert": 8}, **kw),
    "Pack3DSegmenter": lambda **kw: models.Pack3DSegmenter(
        num_classes=2, d_model=48, depth=1, num_heads=2, ffn="flashffn",
        ffn_options={"num_experts": 2, "d_expert": 8}, **kw),
}


def kernel_impls(model) -> set[str]:
  """The resolved impl of every kernel layer inside `model` (itself included)."""
  return {node.impl for _, node in nnx.iter_graph(model)
          if type(node).__name__ in KERNEL_LAYERS[:3]}


@pytest.mark.parametrize("name", LAYERS)
def test_exported_with_shapes_in_docstrings(name):
  cls = getattr(models, name)
  assert name in models.__all__
  for entry in (cls, cls.__call__):
    assert "[" in (inspect.getdoc(entry) or ""), f"{name}: no shapes in {entry.__qualname__}"


@pytest.mark.parametrize("name", KERNEL_LAYERS)
def test_impl_defaults_to_auto_and_every_kernel_layer_takes_interpret(name):
  params = inspect.signature(getattr(models, name).__init__).parameters
  assert params["impl"].default == "auto" and params["interpret"].default is None


@pytest.mark.parametrize("name", KERNEL_LAYERS)
@pytest.mark.parametrize("compiled, expected", [(False, "xla"), (True, "pallas")],
                         ids=["cpu", "tpu_or_gpu"])
def test_auto_is_the_kernel_where_it_compiles(name, compiled, expected, monkeypatch):
  monkeypatch.setattr(impl_module, "compiles_kernels", lambda: compiled)
  model = nnx.eval_shape(lambda: BUILD[name](rngs=nnx.Rngs(0)))
  assert kernel_impls(model) == {expected}
  forced = nnx.eval_shape(lambda: BUILD[name](impl="reference", rngs=nnx.Rngs(0)))
  assert kernel_impls(forced) == {"reference"}


def test_auto_falls_back_where_the_kernel_has_no_option(monkeypatch):
  """Pack3D's gated and local merges have no kernel: "auto" is "xla" even on a TPU/GPU."""
  monkeypatch.setattr(impl_module, "compiles_kernels", lambda: True)
  layer = nnx.eval_shape(lambda: BUILD["Pack3DAttention"](merge="gated", rngs=nnx.Rngs(0)))
  assert layer.impl == "xla"


def test_interpret_reaches_the_kernel_layers():
  model = nnx.eval_shape(lambda: BUILD["LanguageModel"](impl="pallas", interpret=True,
                                                        rngs=nnx.Rngs(0)))
  layers = [node for _, node in nnx.iter_graph(model) if hasattr(node, "interpret")]
  assert len(layers) == 2 and all(layer.interpret is True for layer in layers)
  assert all(block.pallas_mixer and block.pallas_ffn for block in model.blocks)


@pytest.mark.parametrize("name, op", [("FlashFFN", "flash_ffn_routed"), ("FRACMixer", "frac_scan"),
                                      ("Pack3DAttention", "pack3d")])
def test_backend_reaches_the_kernel_and_makes_auto_the_kernel(name, op, monkeypatch):
  """backend= forces a kernel body: "auto" becomes "pallas" (on CPU it runs interpreted) and
  the kernel function is called with that backend."""
  import jax.numpy as jnp
  layer = BUILD[name](backend="triton", rngs=nnx.Rngs(0))
  assert layer.impl == "pallas"
  seen = []
  real = impl_module.OPS[op]["pallas"]
  monkeypatch.setitem(impl_module.OPS[op], "pallas",
                      lambda *a, **kw: seen.append(kw.get("backend")) or real(*a, **kw))
  if name == "Pack3DAttention":
    from neurips26_jax.jaxops import packing
    coords = packing.grid_coords((2, 2, 2))[None]
    layer(jnp.ones((1, 8, 12)), coords, jnp.zeros((1, 8), jnp.int32))
  else:
    layer(jnp.ones((1, 8, 32 if name == "FlashFFN" else 16)))
  assert seen == ["triton"]


def test_kernel_body_reads_the_lowered_program():
  """kernel_body names the body a call lowers to: on CPU the XLA path calls none, and the
  kernel exported for a TPU is Mosaic's."""
  import jax.numpy as jnp
  x = jnp.ones((1, 8, 32))
  assert impl_module.kernel_body(BUILD["FlashFFN"](impl="xla", rngs=nnx.Rngs(0)), x) == "XLA"
  kernel = BUILD["FlashFFN"](impl="pallas", rngs=nnx.Rngs(0))
  assert impl_module.kernel_body(kernel, x, platform="tpu") == "Mosaic TPU"
