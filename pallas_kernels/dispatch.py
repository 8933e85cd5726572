"""Shared by every kernel's entry point: pick the lowering for the platform and the tiles
for the chip.

Each op has a Mosaic (TPU) and a Triton (GPU) kernel body. Its public function builds a
`KernelConfig` from its keyword arguments and runs its forward and backward through
`dispatch`, which uses `jax.lax.platform_dependent` so that one jitted function runs
interpreted on CPU and compiles for TPU and GPU.

Block sizes come from each op's table of tuned entries, keyed by (backend, chip, dtype)
(levanter's `tuned_block_sizes`); every entry is compiled by `make compile-check` for its
chip. The chip is read from `jax.devices()` when the program runs on a TPU or GPU; a
deviceless compile (benchmarks/aot) names it with `target_chip`. An unknown chip gets the
backend's generic entry, which is the smallest chip's (A100, v5e) and so fits them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxops import checks

Backend = Literal["mosaic", "triton"]
_PLATFORM = {"mosaic": "tpu", "triton": "cuda"}
CHIPS = ("tpu-v5e", "tpu-v6e", "gpu-a100", "gpu-h100", "gpu-h200")
_DEVICE_KINDS = (("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v6 lite", "tpu-v6e"),
                 ("v6e", "tpu-v6e"), ("a100", "gpu-a100"), ("h100", "gpu-h100"),
                 ("h200", "gpu-h200"))
_chip_override: list[str] = []


@contextlib.contextmanager
def target_chip(chip: str):
  """Tiles for `chip` (one of CHIPS) while tracing inside this context: for deviceless
  compiles, where jax.devices() are CPUs."""
  if chip not in CHIPS:
    raise ValueError(f"target_chip: `chip` must be one of {CHIPS}, got {chip!r}")
  _chip_override.append(chip)
  try:
    yield
  finally:
    _chip_override.pop()


def current_chip() -> str | None:
  """The chip being compiled for: the override, else the first device's kind, else None."""
  if _chip_override:
    return _chip_override[-1]
  kind = jax.devices()[0].device_kind.lower()
  return next((chip for key, chip in _DEVICE_KINDS if key in kind), None)


def tuned(table: dict, backend: Backend, dtype, default):
  """The table entry for (backend, current chip, dtype name), else (backend, None, dtype),
  else `default`."""
  name = jnp.dtype(dtype).name
  chip = current_chip()
  return table.get((backend, chip, name), table.get((backend, None, name), default))


def check_positive(op: str, blocks) -> None:
  """ValueError naming the first block-size field that is not a positive int."""
  checks.ints(op, dataclasses.asdict(blocks), what="block size ")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """How to run one op's kernels; hashable, so it can be a custom_vjp nondiff argument.

  op: the public name, for error messages.
  blocks_type: the op's frozen block-size dataclass, with `for_backend(backend, dtype)`
    giving the tuned entry for the current chip.
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
    cfg = cls(op, blocks_type, backend, interpret, tuple(sorted(block_sizes.items())))
    check_positive(op, dataclasses.replace(blocks_type(), **block_sizes))
    return cfg

  def blocks_for(self, backend: Backend, dtype):
    return dataclasses.replace(self.blocks_type.for_backend(backend, dtype),
                               **dict(self.overrides))


def dispatch(fn, cfg: KernelConfig, *args):
  """Runs fn(backend, interpret, blocks, *args) with the lowering the platform calls for.

  The block sizes are looked up for the dtype of the first argument."""
  dtype = args[0].dtype
  if cfg.interpret:
    backend = cfg.backend or "mosaic"
    return fn(backend, cfg.interpret, cfg.blocks_for(backend, dtype), *args)

  def branch(backend: Backend, interpret: bool):
    return functools.partial(fn, backend, interpret, cfg.blocks_for(backend, dtype))

  # interpret=False on CPU: the compiled kernel, which Pallas refuses to lower there
  # (raising at trace time instead would also break TPU/GPU: every branch is traced).
  default = branch(cfg.backend or "mosaic", cfg.interpret is None)
  backends = (cfg.backend,) if cfg.backend else ("mosaic", "triton")
  return jax.lax.platform_dependent(
      *args, default=default, **{_PLATFORM[b]: branch(b, False) for b in backends})
