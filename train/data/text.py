"""Byte-level text: a corpus as uint8 bytes, a deterministic train/val split, random windows.

The default corpus is the running interpreter's standard library source (every `*.py` under
`sysconfig`'s stdlib directory, sorted by path, without test suites and site-packages), so it
exists on any machine with Python; `path` may name any file instead.
"""

from __future__ import annotations

import pathlib
import sysconfig

import numpy as np

_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3"})
TRAIN, VAL = 0, 1


def stdlib_files() -> list[pathlib.Path]:
  """The stdlib's *.py files in sorted order (test suites and installed packages left out)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return [f for f in sorted(root.rglob("*.py"))
          if not _SKIP_DIRS.intersection(f.relative_to(root).parts[:-1])]


def load_corpus(path: str = "", *, max_bytes: int = 0) -> np.ndarray:
  """The bytes of `path` (or of the stdlib corpus when empty) as uint8 [n], cut to max_bytes if > 0."""
  if path:
    p = pathlib.Path(path)
    if not p.is_file():
      raise ValueError(f"text data: `path` {path!r} is not a file")
    data = p.read_bytes()
  else:
    parts, size = [], 0
    for f in stdlib_files():
      if 0 < max_bytes <= size:
        break
      parts.append(f.read_bytes())
      size += len(parts[-1])
    data = b"".join(parts)
  return np.frombuffer(data[:max_bytes] if max_bytes > 0 else data, np.uint8)


def split(corpus: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  """(train, val): the first 1 - val_fraction of the bytes and the rest."""
  if not 0 < val_fraction < 1:
    raise ValueError(f"text data: `val_fraction` must be in (0, 1), got {val_fraction}")
  cut = int(len(corpus) * (1 - val_fraction))
  return corpus[:cut], corpus[cut:]


def windows(data: np.ndarray, *, seed: int, stream: int, index: int, batch: int,
            length: int) -> np.ndarray:
  """batch random windows of length + 1 bytes -> int32 [batch, length + 1].

  A pure function of (seed, stream, index): stream TRAIN with index = step, VAL with index = the
  evaluation batch number.
  """
  if len(data) < length + 2:
    raise ValueError(f"text data: {len(data)} bytes cannot hold a window of {length + 1}")
  starts = np.random.default_rng([seed, stream, index]).integers(0, len(data) - length, batch)
  return np.stack([data[s:s + length + 1] for s in starts]).astype(np.int32)
