"""Which implementation of an op a layer calls, one vocabulary for every layer and model.

  "auto"       the default: "pallas" where the default backend compiles the kernels (TPU:
               Mosaic; NVIDIA GPU: Mosaic GPU or Triton by op, chip and dtype, as
               `pallas_kernels.dispatch` picks: README's table, `python -m
               tools.kernel_table`), "xla" elsewhere (CPU, or a layer option the kernel
               does not cover); resolved when the layer is built
  "pallas"     the Pallas kernel; on CPU it runs in interpret mode (slow, for tests)
  "xla"        the fast pure-XLA path (`jaxops`)
  "reference"  the plain reference (`jaxops`), for checking

`interpret` (on every layer that has a kernel) is passed to the kernel: None interprets on
CPU only, True everywhere (or a `pltpu.InterpretParams`), False never.

`OPS` is the one implementation table: for each op, what every resolved impl calls, with one
signature per op (`call`); `CHUNKS` holds each op's one default chunk.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Literal, get_args

import jax
from flax import nnx
from jax.extend import backend as jax_backend

from neurips26_jax.jaxops import checks
from neurips26_jax.jaxops import flash_ffn as ffn_ops
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops import pack3d as pack3d_ops
from neurips26_jax.pallas_kernels import flash_ffn as ffn_kernel
from neurips26_jax.pallas_kernels import frac_scan as frac_kernel
from neurips26_jax.pallas_kernels import pack3d_attention as pack3d_kernel
from neurips26_jax.pallas_kernels.dispatch import BACKENDS

Impl = Literal["auto", "pallas", "xla", "reference"]
IMPLS: tuple[str, ...] = get_args(Impl)


def compiles_kernels() -> bool:
  """Whether the default backend compiles the Pallas kernels: TPU, or a CUDA GPU (the Triton
  kernels are lowered for CUDA only; a ROCm GPU would fall back to interpreting)."""
  backend = jax.default_backend()
  return backend == "tpu" or (backend in ("gpu", "cuda")
                              and "cuda" in jax_backend.backends())


def resolve_impl(owner: str, impl: str, *, has_kernel: bool = True,
                 backend: str | None = None) -> str:
  """`impl` checked against IMPLS, with "auto" replaced by "pallas" or "xla" (see above).

  has_kernel=False: the layer's configuration has no kernel, so "auto" is "xla".
  backend: a kernel body to force ("mosaic", "triton", "mosaic_gpu"; None: the dispatch's
  choice); it makes "auto" "pallas" (on CPU the chosen body then runs interpreted) and is an
  error beside "xla", "reference" or a configuration without a kernel.
  """
  checks.one_of(owner, "impl", impl, IMPLS)
  if backend is not None:
    checks.one_of(owner, "backend", backend, BACKENDS)
    if impl not in ("auto", "pallas") or not has_kernel:
      why = f"impl={impl!r}" if has_kernel else "this configuration, which has no kernel"
      raise ValueError(f"{owner}: `backend` ({backend!r}) picks a kernel body, but {why} runs "
                       "no kernel; use impl='pallas' or 'auto'")
    return "pallas"
  if impl != "auto":
    return impl
  return "pallas" if has_kernel and compiles_kernels() else "xla"


# Each kernel body's custom call in a lowered program (`kernel_body`).
BODY_CALLS = {"Mosaic TPU": "tpu_custom_call", "Mosaic GPU": "mosaic_gpu",
              "Triton": "__gpu$xla.gpu.triton"}
# GPUs a "cuda" lowering can be for without one (`export_mlir`): Pallas reads the compute
# capability, and the dispatch the chip, from the device kind.
AMPERE_DEVICE_KIND = "NVIDIA A100-SXM4-80GB"
HOPPER_DEVICE_KIND = "NVIDIA H100 80GB HBM3"
BLACKWELL_DEVICE_KIND = "NVIDIA B200"
_GPU_CUSTOM_CALLS = (BODY_CALLS["Triton"], "mosaic_gpu_v2")   # what a "cuda" export may call


def export_mlir(fn: Callable[..., Any], platform: str, *args: Any,
                device_kind: str = HOPPER_DEVICE_KIND) -> str:
  """jit(fn)(*args) lowered for `platform` ("tpu", or "cuda" for the GPU `device_kind`) from
  any machine, as StableHLO text. A "cuda" lowering without a GPU takes the device from an
  abstract mesh (Auto axes, as a deviceless compile's: tables an op computes eagerly while
  tracing stay unsharded)."""
  disabled, target = [], contextlib.nullcontext()
  if platform == "cuda":
    disabled = [jax.export.DisabledSafetyCheck.custom_call(c) for c in _GPU_CUSTOM_CALLS]
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None,
                                         platform="cuda")
    target = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
        (1,), ("gpu",), (jax.sharding.AxisType.Auto,), abstract_device=device))
  with target:
    exported = jax.export.export(jax.jit(fn), platforms=[platform],
                                 disabled_checks=disabled)(*args)
  return exported.mlir_module()


def kernel_body(fn: Callable[..., Any] | nnx.Module, *args: Any, platform: str | None = None,
                device_kind: str = HOPPER_DEVICE_KIND) -> str:
  """Which kernel body fn(*args) runs, read from its lowered program: "Mosaic TPU", "Mosaic
  GPU", "Triton", or "XLA" when it calls none (the XLA path or the reference, or a kernel
  interpreted on CPU). `fn` may be an NNX layer: `kernel_body(FlashFFN(64, rngs=rngs), x)`.

  platform: None lowers for the default backend; "tpu" or "cuda" (the GPU `device_kind`, an
  H100 unless given) lowers for that chip from any machine. A layer whose impl resolved to
  "xla" runs no kernel anywhere, so asking another platform about it is a ValueError: "auto"
  resolves on the machine that builds the layer (to "xla" on CPU); build it with
  impl="pallas" to read what a TPU or GPU runs.
  """
  if isinstance(fn, nnx.Module):
    on_xla = [type(m).__name__ for _, m in nnx.iter_graph(fn)
              if isinstance(m, nnx.Module) and getattr(m, "impl", "") == "xla"]
    if platform not in (None, jax.default_backend()) and on_xla:
      raise ValueError(
          f"kernel_body: `platform`={platform!r} asks what that chip runs, but {on_xla[0]} was "
          f"built with impl 'xla' (what impl='auto' is on this {jax.default_backend()} "
          "machine), which runs no kernel on any chip: build it with impl='pallas'")
    graphdef, state = nnx.split(fn)
    fn, args = (lambda state, *a: nnx.merge(graphdef, state)(*a)), (state, *args)
  if platform is None:
    text = jax.jit(fn).lower(*args).as_text()
  else:
    text = export_mlir(fn, platform, *args, device_kind=device_kind)
  found = [name for name, call in BODY_CALLS.items() if call in text]
  return " + ".join(found) or "XLA"


# The XLA paths' default chunks: tokens per step (flash_ffn), scan chunk length (frac_scan),
# query cubes per step (pack3d). The kernels take their chunks from their tuned block tables
# unless a layer sets one.
CHUNKS = {"flash_ffn": 512, "flash_ffn_routed": 512, "frac_scan": 64, "pack3d": 16}


def _pack3d_kernel(q, k, v, coords, field_ids, *, chunk, interpret, gates=None, **options):
  del chunk                         # query cubes per program come from the kernel's tiles
  if gates is not None:
    raise ValueError("pack3d_attention: `gates` (merge 'gated' or 'local') needs impl='xla' "
                     "or 'reference'")
  return pack3d_kernel.pack3d_attention(q, k, v, coords, field_ids, interpret=interpret,
                                        **options)


def _pack3d_reference(q, k, v, coords, field_ids, *, chunk, interpret, max_cubes=None,
                      **options):
  del chunk, interpret, max_cubes   # dense: no cube slots, no chunks
  return pack3d_ops.pack3d_attention_reference(q, k, v, coords, field_ids, **options)


# op -> impl -> fn(*arrays, chunk=, interpret=, **options). chunk is the layer's (None: the
# kernel's own tiles, or CHUNKS[op] on the XLA path).
OPS = {
    "flash_ffn": {
        "pallas": lambda *a, chunk, interpret, **o: ffn_kernel.mhffn(*a, interpret=interpret,
                                                                     **o),
        "xla": lambda *a, chunk, interpret: ffn_ops.mhffn(*a, chunk=chunk),
        "reference": lambda *a, chunk, interpret: ffn_ops.mhffn_reference(*a),
    },
    # FlashFFN's head norm (with its gain), router and mixture from W_in's output (the
    # layer's op): (q, w_r, k, u, v, gain or None), tables in any float dtype.
    "flash_ffn_routed": {
        "pallas": lambda *a, chunk, interpret, normalize, **o: ffn_kernel.mhffn_routed(
            *a[:5], gain=a[5], normalize=normalize, interpret=interpret, **o),
        "xla": lambda *a, chunk, interpret, normalize: ffn_ops.mhffn_routed(
            *a[:5], gain=a[5], normalize=normalize, chunk=chunk),
        "reference": lambda *a, chunk, interpret, normalize: ffn_ops.mhffn_routed_reference(
            *a[:5], gain=a[5], normalize=normalize),
    },
    "frac_scan": {
        "pallas": lambda *a, chunk, interpret, **o: frac_kernel.frac_scan(
            *a, interpret=interpret, **({} if chunk is None else {"chunk": chunk}), **o),
        "xla": lambda *a, chunk, interpret: frac_ops.frac_scan(*a, chunk=chunk),
        "reference": lambda *a, chunk, interpret: frac_ops.frac_scan_reference(*a),
    },
    "pack3d": {
        "pallas": _pack3d_kernel,
        "xla": lambda *a, chunk, interpret, **o: pack3d_ops.pack3d_attention(*a, chunk=chunk, **o),
        "reference": _pack3d_reference,
    },
}


def call(op: str, impl: str, *arrays: jax.Array, chunk: int | None = None, interpret: Any = None,
         backend: str | None = None, **options: Any) -> Any:
  """OPS[op][impl](*arrays, ...) for a resolved impl ("pallas", "xla" or "reference"); the XLA
  path gets `chunk` or CHUNKS[op]; the kernel gets `backend` when one is forced."""
  if impl == "xla" and chunk is None:
    chunk = CHUNKS[op]
  if backend is not None:
    options["backend"] = backend
  return OPS[op][impl](*arrays, chunk=chunk, interpret=interpret, **options)
