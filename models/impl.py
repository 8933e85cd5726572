"""Which implementation of an op a layer calls: the Pallas kernel, the XLA path or the reference."""

from __future__ import annotations

from typing import Literal, get_args

Impl = Literal["pallas", "xla", "reference"]
IMPLS: tuple[str, ...] = get_args(Impl)


def check_impl(layer: str, impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"{layer}: `impl` must be one of {IMPLS}, got {impl!r}")
