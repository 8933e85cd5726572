"""The public API is typed: every parameter and return of the calls listed below is annotated,
and each annotation names something that exists.

The bug this catches: a public call added, or one whose parameters changed, without its types.
The package ships py.typed, which tells type checkers (mypy, pyright) that its public API is
typed; an unannotated parameter or return is then silently `Any` to them, so a user's checker
stops checking the arguments passed there (or what comes back), and nothing else fails. The
calls are listed explicitly, and the `*_is_listed` tests fail on a public layer method, op or
export that is not in the lists, so a new one cannot be added untyped either. Only signatures
are read (inspect.signature, typing.get_type_hints): nothing is built or run.
"""

from __future__ import annotations

import inspect
import types
import typing

import pytest

from neurips26_jax import models, train
from neurips26_jax.jaxops import flash_ffn, frac, pack3d, packing, rms_norm, rope
from neurips26_jax.pallas_kernels import flash_ffn as flash_ffn_kernel
from neurips26_jax.pallas_kernels import frac_scan as frac_scan_kernel
from neurips26_jax.pallas_kernels import pack3d_attention as pack3d_kernel
from neurips26_jax.train import inference

# Each exported layer or model: the public methods users call, beside __init__.
LAYER_METHODS = {
    models.Block: ("__call__", "step"),
    models.CausalAttention: ("__call__", "init_cache", "step"),
    models.FRACMixer: ("__call__", "scan_output", "init_cache", "step", "alpha", "modes"),
    models.FlashFFN: ("__call__",),
    models.LanguageModel: ("__call__", "features", "logits", "init_cache", "step", "generate"),
    models.Pack3DAttention: ("__call__",),
    models.Pack3DSegmenter: ("__call__",),
    models.RMSNorm: ("__call__",),
    models.SwiGLU: ("__call__",),
    models.UNet3D: ("__call__",),
}

# The ops' public functions, module by module (every public function each module defines).
OPS = {
    flash_ffn: (flash_ffn.mhffn, flash_ffn.mhffn_reference, flash_ffn.mhffn_routed,
                flash_ffn.mhffn_routed_reference, flash_ffn.route_heads, flash_ffn.fold_gain,
                flash_ffn.fold_router_gain, flash_ffn.check_mhffn_inputs, flash_ffn.swiglu),
    frac: (frac.frac_scan, frac.frac_scan_reference, frac.frac_step, frac.soe_modes,
           frac.soe_kernel, frac.default_num_modes, frac.check_scan_inputs, frac.zero_state,
           frac.scan_vjp),
    pack3d: (pack3d.pack3d_attention, pack3d.pack3d_attention_reference,
             pack3d.check_pack3d_inputs, pack3d.cube_summaries, pack3d.per_token_cube_sum),
    packing: (packing.grid_coords, packing.patchify, packing.unpatchify, packing.pack_fields,
              packing.unpack_fields, packing.morton_key, packing.hilbert_key,
              packing.layout_permutation),
    rope: (rope.rotate, rope.rope_angles, rope.rope_1d, rope.axial_rope_3d_float,
           rope.axial_rope_3d),
    rms_norm: (rms_norm.rms_normalize, rms_norm.rms_normalize_groups),
}

# The kernels' entry points (each package's public functions in its __all__).
KERNELS = {
    flash_ffn_kernel: (flash_ffn_kernel.mhffn, flash_ffn_kernel.mhffn_routed),
    frac_scan_kernel: (frac_scan_kernel.frac_scan,),
    pack3d_kernel: (pack3d_kernel.pack3d_attention, pack3d_kernel.kernel_operands),
}

FUNCTIONS = (
    models.default_d_expert, models.unet3d_matching, models.voxel_logits,
    models.impl.kernel_body,
    *(f for fns in OPS.values() for f in fns),
    *(f for fns in KERNELS.values() for f in fns),
    inference.load_model, inference.load_config, inference.evaluate, inference.load,
    inference.restore_params, inference.task_module, inference.inference_config,
)

CALLS = ([(f"{cls.__name__}.{name}", getattr(cls, name))
          for cls, methods in LAYER_METHODS.items() for name in ("__init__", *methods)]
         + [(f"{f.__module__.removeprefix('neurips26_jax.')}.{f.__name__}", f)
            for f in FUNCTIONS])


def _public_functions(namespace: dict, module: str) -> set[str]:
  """The public functions (plain or wrapped, e.g. by jax.custom_vjp) that `namespace` defines
  in `module` itself, not imported ones."""
  return {name for name, value in namespace.items()
          if not name.startswith("_") and callable(value) and not isinstance(value, type)
          and getattr(value, "__module__", None) == module}


@pytest.mark.parametrize("fn", [fn for _, fn in CALLS], ids=[name for name, _ in CALLS])
def test_every_parameter_and_the_return_is_annotated(fn):
  signature = inspect.signature(fn)
  variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
  missing = [name for name, p in signature.parameters.items()
             if name != "self" and p.kind not in variadic and p.annotation is p.empty]
  if signature.return_annotation is signature.empty:
    missing.append("the return")
  assert not missing, f"no type hint on {missing}"
  # each hint resolves (a misspelt name, or one the module does not import, fails here)
  typing.get_type_hints(inspect.unwrap(fn))


def test_every_exported_layer_and_function_is_listed():
  listed = set(LAYER_METHODS) | set(FUNCTIONS)
  exported = [getattr(models, name) for name in models.__all__]
  callables = [obj for obj in exported
               if isinstance(obj, type) or isinstance(obj, types.FunctionType)]
  assert [obj for obj in callables if obj not in listed] == []


def test_every_public_layer_method_is_listed():
  for cls, methods in LAYER_METHODS.items():
    own = _public_functions(vars(cls), cls.__module__)
    assert own <= set(methods), f"{cls.__name__}: {sorted(own - set(methods))} not listed"


@pytest.mark.parametrize("module", list(OPS) + list(KERNELS),
                         ids=lambda m: m.__name__.removeprefix("neurips26_jax."))
def test_every_public_op_is_listed(module):
  listed = {f.__name__ for f in (OPS | KERNELS)[module]}
  if module in KERNELS:
    public = {name for name in module.__all__ if callable(getattr(module, name))
              and not isinstance(getattr(module, name), type)}
  else:
    public = _public_functions(vars(module), module.__name__)
  assert public <= listed, f"{sorted(public - listed)} not listed"


def test_every_lazy_train_export_is_listed():
  assert set(train.__all__) <= {f.__name__ for f in FUNCTIONS if f.__module__ == inference.__name__}
