"""Which implementation of an op a layer calls, one vocabulary for every layer and model.

  "auto"       the default: "pallas" where the default backend compiles the kernels (TPU:
               Mosaic, NVIDIA GPU: Triton), "xla" elsewhere (CPU, or a layer option the
               kernel does not cover); resolved when the layer is built
  "pallas"     the Pallas kernel; on CPU it runs in interpret mode (slow, for tests)
  "xla"        the fast pure-XLA path (`jaxops`)
  "reference"  the plain reference (`jaxops`), for checking

`interpret` (on every layer that has a kernel) is passed to the kernel: None interprets on
CPU only, True everywhere (or a `pltpu.InterpretParams`), False never.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
from jax.extend import backend as jax_backend

from jaxops import checks

Impl = Literal["auto", "pallas", "xla", "reference"]
IMPLS: tuple[str, ...] = get_args(Impl)


def compiles_kernels() -> bool:
  """Whether the default backend compiles the Pallas kernels: TPU, or a CUDA GPU (the Triton
  kernels are lowered for CUDA only; a ROCm GPU would fall back to interpreting)."""
  backend = jax.default_backend()
  return backend == "tpu" or (backend in ("gpu", "cuda")
                              and "cuda" in jax_backend.backends())


def resolve_impl(owner: str, impl: str, *, has_kernel: bool = True) -> str:
  """`impl` checked against IMPLS, with "auto" replaced by "pallas" or "xla" (see above).

  has_kernel=False: the layer's configuration has no kernel, so "auto" is "xla".
  """
  checks.one_of(owner, "impl", impl, IMPLS)
  if impl != "auto":
    return impl
  return "pallas" if has_kernel and compiles_kernels() else "xla"
