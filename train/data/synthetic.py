"""Synthetic sequence tasks for memory and recall, as masked sequence-to-sequence batches.

Every generator returns {"inputs": int32 [B, L], "targets": int32 [B, L], "mask": f32 [B, L]}:
the model reads `inputs` causally and is scored on `targets` where mask = 1. Batches are pure
functions of (seed, stream, index). Token ids: 0 = blank, 1 = separator, data tokens from 2.

- MQAR (multi-query associative recall): `num_pairs` key-value pairs, then each key is asked
  again at a gap after its pair drawn from a power law p(g) ~ g^(power - 1); the answer is
  the value. Keys from the lower half of the data tokens, values from the upper half.
- Lag recall: a random data sequence; the first token names the lag (one of the log-spaced
  lags 1, 2, 4, ... < L / 2); from position `lag` on, the target is the input `lag` steps back.
- Selective copying: `num_tokens` data tokens scattered at random positions among blanks in
  the first L - num_tokens positions, a separator at position L - num_tokens, then blanks;
  from the separator on, the model must emit the data tokens in order.
"""

from __future__ import annotations

import numpy as np

FIRST = 2          # first data token id


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
  return np.random.default_rng([seed, stream, index])


def _check(name: str, ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(f"{name}: {message}")


def power_law_gaps(rng, count: int, max_gap: int, power: float) -> np.ndarray:
  """count gaps in [1, max_gap] with p(g) proportional to g^(power - 1)."""
  g = np.arange(1, max_gap + 1)
  p = g ** (power - 1.0)
  return rng.choice(g, size=count, p=p / p.sum())


def mqar(*, seed: int, stream: int, index: int, batch: int, length: int, vocab: int,
         num_pairs: int, power: float = 0.01) -> dict:
  """MQAR batch; each of the num_pairs keys is queried once after the pairs (see module doc)."""
  half = (vocab - FIRST) // 2
  _check("mqar", half >= num_pairs, f"vocab {vocab} has too few tokens for {num_pairs} keys")
  _check("mqar", length >= 4 * num_pairs, f"length {length} < 4 * num_pairs ({4 * num_pairs})")
  rng = _rng(seed, stream, index)
  inputs = np.zeros((batch, length), np.int32)
  targets = np.zeros((batch, length), np.int32)
  mask = np.zeros((batch, length), np.float32)
  start = 2 * num_pairs                      # queries live in [start, length)
  for b in range(batch):
    keys = FIRST + rng.choice(half, num_pairs, replace=False)
    values = FIRST + half + rng.integers(0, half, num_pairs)
    inputs[b, 0:start:2], inputs[b, 1:start:2] = keys, values
    free = np.ones(length, bool)
    free[:start] = False
    for i in rng.permutation(num_pairs):
      gap = power_law_gaps(rng, 1, length, power)[0]
      # the nearest free slot to the pair's position + gap (slots are finite: wrap to any free)
      slots = np.flatnonzero(free)
      pos = slots[np.argmin(np.abs(slots - (2 * i + 1 + gap)))]
      free[pos] = False
      inputs[b, pos], targets[b, pos], mask[b, pos] = keys[i], values[i], 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def log_spaced_lags(length: int) -> np.ndarray:
  """1, 2, 4, ... up to (not including) length / 2."""
  return 2 ** np.arange(int(np.ceil(np.log2(max(length // 2, 2)))))


def lag_recall(*, seed: int, stream: int, index: int, batch: int, length: int,
               vocab: int) -> dict:
  """Lag-recall batch; input 0 is the lag token FIRST + j for lag 2^j (see module doc)."""
  lags = log_spaced_lags(length)
  _check("lag_recall", vocab > FIRST + len(lags), f"vocab {vocab} too small for {len(lags)} lags")
  rng = _rng(seed, stream, index)
  choice = rng.integers(0, len(lags), batch)
  inputs = rng.integers(FIRST, vocab, (batch, length)).astype(np.int32)
  inputs[:, 0] = FIRST + choice
  targets = np.zeros_like(inputs)
  mask = np.zeros((batch, length), np.float32)
  for b, lag in enumerate(lags[choice]):
    targets[b, 1 + lag:] = inputs[b, 1:length - lag]
    mask[b, 1 + lag:] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def selective_copy(*, seed: int, stream: int, index: int, batch: int, length: int, vocab: int,
                   num_tokens: int) -> dict:
  """Selective-copying batch (see module doc)."""
  region = length - num_tokens
  _check("selective_copy", region >= num_tokens,
         f"length {length} too short for {num_tokens} tokens to copy")
  rng = _rng(seed, stream, index)
  inputs = np.zeros((batch, length), np.int32)
  targets = np.zeros((batch, length), np.int32)
  mask = np.zeros((batch, length), np.float32)
  for b in range(batch):
    data = rng.integers(FIRST, vocab, num_tokens)
    positions = np.sort(rng.choice(region, num_tokens, replace=False))
    inputs[b, positions] = data
    inputs[b, region] = 1
    targets[b, region:region + num_tokens] = data
    mask[b, region:region + num_tokens] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


TASKS = {"mqar": mqar, "lag_recall": lag_recall, "selective_copy": selective_copy}
