"""Shared by every kernel's entry point: pick the lowering for the platform.

Each op has a Mosaic (TPU) and a Triton (GPU) kernel body. Its public function builds a
`KernelConfig` from its keyword arguments and runs its forward and backward through
`dispatch`, which uses `jax.lax.platform_dependent` so that one jitted function runs
interpreted on CPU and exports for `platforms=["tpu"]` and `["cuda"]`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax

Backend = Literal["mosaic", "triton"]
_PLATFORM = {"mosaic": "tpu", "triton": "cuda"}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How to run one op's kernels; hashable, so it can be a custom_vjp nondiff argument.

  op: the public name, for error messages.
  blocks_type: the op's frozen block-size dataclass, with `for_backend(backend)` defaults.
  backend: None picks per platform; "mosaic" or "triton" forces one kernel body.
  interpret: None interprets on CPU only; True (or `pltpu.InterpretParams`) everywhere;
    False never.
  overrides: block-size fields set by the caller, as sorted (name, value) pairs.
  """

  op: str
  blocks_type: type
  backend: Backend | None
  interpret: Any
  overrides: tuple

  @classmethod
  def make(cls, op: str, blocks_type: type, *, backend, interpret, block_sizes: dict):
    known = {f.name for f in dataclasses.fields(blocks_type)}
    unknown = set(block_sizes) - known
    if unknown:
      raise ValueError(f"{op}: unknown block size(s) {sorted(unknown)}; expected some of "
                       f"{sorted(known)}")
    if backend not in (None, "mosaic", "triton"):
      raise ValueError(f"{op}: `backend` must be None, 'mosaic' or 'triton', got {backend!r}")
    return cls(op, blocks_type, backend, interpret, tuple(sorted(block_sizes.items())))

  def blocks_for(self, backend: Backend):
    return dataclasses.replace(self.blocks_type.for_backend(backend), **dict(self.overrides))


def dispatch(fn, cfg: KernelConfig, *args):
  """Runs fn(backend, interpret, blocks, *args) with the lowering the platform calls for."""
  if cfg.interpret:
    backend = cfg.backend or "mosaic"
    return fn(backend, cfg.interpret, cfg.blocks_for(backend), *args)

  def branch(backend: Backend, interpret: bool):
    return functools.partial(fn, backend, interpret, cfg.blocks_for(backend))

  def no_kernel(*_):
    raise ValueError(f"{cfg.op}: no compiled Pallas lowering for this platform; "
                     "pass interpret=True")

  default = branch(cfg.backend or "mosaic", True) if cfg.interpret is None else no_kernel
  backends = (cfg.backend,) if cfg.backend else ("mosaic", "triton")
  return jax.lax.platform_dependent(
      *args, default=default, **{_PLATFORM[b]: branch(b, False) for b in backends})
