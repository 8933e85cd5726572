"""Input checks shared by the public ops (`jaxops`, `pallas_kernels`) and layers (`models`).

Every check raises with a message that starts with the op or layer (`owner`), names the
argument in backticks, gives its value or shape, and says what was expected:
ValueError for sizes, shapes and values; `DtypeError` (a TypeError) for dtypes.

Shape and size checks run at trace time, so they hold under `jax.jit` at no run-time cost.
Value checks (`values`) look at the numbers only when they are concrete (numpy arrays, jax
arrays outside `jit` or closed over by it). A traced value cannot raise from a compiled
program, and a host callback would stall every step, so there the check is a
`checkify.debug_check`: free in a plain `jit`, reported when the caller runs the function
under `checkify.checkify(f, errors=checkify.user_checks)`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


class DtypeError(TypeError, ValueError):
  """A wrong dtype. Also a ValueError, so callers that catch ValueError for any bad input
  (the config-driven model builders) still do."""


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def concrete(x) -> np.ndarray | None:
  """x as a numpy array, or None when it is traced."""
  return None if is_traced(x) else np.asarray(x)


def ints(owner: str, values: Mapping[str, Any], *, minimum: int = 1, what: str = "") -> None:
  """ValueError naming the first of `values` that is not an int >= minimum (bools are not)."""
  expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
  for name, value in values.items():
    if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
        or value < minimum):
      raise ValueError(f"{owner}: {what}`{name}` must be {expected}, got {value!r}")


def zyx(owner: str, name: str, value) -> None:
  """ValueError unless value is 3 positive ints (a patch or cube shape, z, y, x)."""
  if np.shape(value) != (3,):
    raise ValueError(f"{owner}: `{name}` must be 3 positive ints (z, y, x), got {value!r}")
  ints(owner, {f"{name}[{a}]": size for a, size in enumerate(value)})


def given(**values) -> dict:
  """The keyword arguments that are not None (optional sizes are checked only when set)."""
  return {name: value for name, value in values.items() if value is not None}


def options(owner: str, name: str, given: Mapping[str, Any], constructor: Callable,
            taken: Sequence[str] = ()) -> None:
  """ValueError if the dict `given` (argument `name`: extra keyword arguments for
  `constructor`) has a key the constructor does not take, or one `owner` sets itself."""
  params = inspect.signature(constructor.__init__ if isinstance(constructor, type)
                             else constructor).parameters
  takes = {k for k, p in params.items()
           if k != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  allowed = sorted(takes - set(taken) - {"rngs"})
  if unknown := sorted(set(given) - takes):
    raise ValueError(f"{owner}: `{name}` has {unknown}, not an argument of "
                     f"{constructor.__name__}; its arguments are {allowed}")
  if fixed := sorted(set(given) & (set(taken) | {"rngs"})):
    raise ValueError(f"{owner}: `{name}` sets {fixed}, which {owner} sets itself; "
                     f"{constructor.__name__}'s other arguments are {allowed}")


def one_of(owner: str, name: str, value, allowed: Sequence) -> None:
  if value not in allowed:
    raise ValueError(f"{owner}: `{name}` must be one of {tuple(allowed)}, got {value!r}")


def multiple(owner: str, what: str, value: int, of: int, of_what: str | None = None) -> None:
  """ValueError unless `value` (described by `what`) is a multiple of `of` (`of_what`)."""
  if value % of:
    expected = f"{of_what} ({of})" if of_what else of
    raise ValueError(f"{owner}: {what} ({value}) must be a multiple of {expected}")


def shape(owner: str, name: str, x, expected: Sequence[int | None], layout: str) -> None:
  """ValueError unless x has len(expected) dims matching `expected` (None: any size)."""
  if x.ndim != len(expected) or any(e is not None and s != e
                                    for s, e in zip(x.shape, expected)):
    raise ValueError(f"{owner}: `{name}` must be {layout}, got shape {tuple(x.shape)}")


def nonempty(owner: str, name: str, x, layout: str) -> None:
  """ValueError when a dimension of x is 0 (an empty sequence, batch, or head axis)."""
  if 0 in x.shape:
    raise ValueError(f"{owner}: `{name}` has shape {tuple(x.shape)}; expected {layout} with"
                     " every size >= 1 (no empty sequence or batch)")


def sequence(owner: str, name: str, x, width: int, width_name: str = "d_model") -> None:
  """A sequence layer's input: float [B, L, width] with B, L >= 1."""
  layout = f"[B, L, {width_name}={width}]"
  shape(owner, name, x, (None, None, width), layout)
  floating(owner, name, x)
  nonempty(owner, name, x, layout)


def features(owner: str, name: str, x, width: int, width_name: str = "d_model") -> None:
  """A token-wise layer's input: float [..., width] holding at least one token."""
  layout = f"[..., {width_name}={width}]"
  if x.ndim < 1 or x.shape[-1] != width:
    raise ValueError(f"{owner}: `{name}` must be {layout}, got shape {tuple(x.shape)}")
  floating(owner, name, x)
  nonempty(owner, name, x, layout)


def floating(owner: str, name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise DtypeError(f"{owner}: `{name}` must be floating point (e.g. float32, bfloat16),"
                     f" got {x.dtype}")


def integer(owner: str, name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise DtypeError(f"{owner}: `{name}` must be integer (e.g. int32), got {x.dtype}")


def values(owner: str, name: str, x, ok: Callable, expected: str) -> None:
  """Raises unless ok(x) holds everywhere: `ok` maps an array (numpy or jax, float32 for
  floating x) to a boolean array and uses only operators and methods common to both.

  Concrete x: ValueError with how many entries fail and x's range. Traced x: a
  `checkify.debug_check` (see the module docstring)."""
  value = concrete(x)
  if value is None:
    x32 = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x
    checkify.debug_check(jnp.all(ok(x32)), f"{owner}: `{name}` must {expected}")
    return
  if jnp.issubdtype(value.dtype, jnp.floating):
    value = value.astype(np.float32)
  good = np.asarray(ok(value))
  if not good.all():
    low, high = (value.min(), value.max()) if value.size else (None, None)
    raise ValueError(f"{owner}: `{name}` (shape {value.shape}) must {expected}; {np.sum(~good)}"
                     f" of {good.size} entries do not (values in [{low}, {high}])")


def finite(v):
  """Elementwise: not inf and not NaN (numpy and jax alike), for use inside `ok`."""
  return abs(v) < float("inf")
