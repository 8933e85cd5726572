"""Long-memory probes for experiment 3: lag recall with given lags, MQAR gaps, accuracy by bucket.

Lag recall here differs from `train.data.synthetic.lag_recall` in two ways that make the
accuracy-against-lag curve clean: the lags are given (log-spaced up to 2048 in the config,
not bounded by L / 2), and every lag is scored on the same positions t in [max(lags) + 1, L),
so each lag weighs the same in the loss and in the evaluation. Token 0 names the lag
(FIRST + j for lags[j]); the target at t is the input at t - lag.

MQAR is `train.data.synthetic.mqar` itself (power-law gaps); `kv_recall` is MQAR with random
distractors instead of blanks between the queries; `mqar_gaps` recovers each query's gap
(query position minus its pair's value position) from a batch of either.
"""

from __future__ import annotations

import numpy as np

from neurips26_jax.train.data import synthetic
from neurips26_jax.train.data.synthetic import FIRST


def lag_recall_lags(*, seed: int, stream: int, index: int, batch: int, length: int, vocab: int,
                    lags, lag_index: int | None = None) -> dict:
  """Lag-recall batch with the given lags (see the module doc); `lag_index` fixes the lag of
  every sequence (evaluation), None draws one per sequence."""
  lags = np.asarray(lags, np.int64)
  start = int(lags.max()) + 1
  if length <= start:
    raise ValueError(f"lag_recall_lags: length {length} must exceed max(lags) + 1 = {start}")
  if vocab <= FIRST + len(lags):
    raise ValueError(f"lag_recall_lags: vocab {vocab} too small for {len(lags)} lag tokens")
  rng = np.random.default_rng([seed, stream, index])
  choice = (rng.integers(0, len(lags), batch) if lag_index is None
            else np.full(batch, lag_index, np.int64))
  inputs = rng.integers(FIRST, vocab, (batch, length)).astype(np.int32)
  inputs[:, 0] = FIRST + choice
  targets = np.zeros_like(inputs)
  for b, lag in enumerate(lags[choice]):
    targets[b, start:] = inputs[b, start - lag:length - lag]
  mask = np.zeros((batch, length), np.float32)
  mask[:, start:] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def mqar_gaps(batch: dict) -> np.ndarray:
  """int [B, L]: for each query position (mask 1), its position minus the position of the
  value of the pair it asks about; -1 elsewhere. Keys sit at even positions 0, 2, ... of the
  pair region, each key once per sequence."""
  inputs, mask = batch["inputs"], batch["mask"]
  gaps = np.full(inputs.shape, -1, np.int64)
  for b in range(inputs.shape[0]):
    queries = np.flatnonzero(mask[b])
    pairs = 2 * len(queries)
    key_pos = {int(k): i for i, k in enumerate(inputs[b, 0:pairs:2])}
    for pos in queries:
      gaps[b, pos] = pos - (2 * key_pos[int(inputs[b, pos])] + 1)
  return gaps


def bucket_accuracy(correct: np.ndarray, keys: np.ndarray, edges) -> list[dict]:
  """Accuracy of `correct` (bool, flattened alongside `keys`) per bucket [edges[i], edges[i+1])."""
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    sel = (keys >= lo) & (keys < hi)
    n = int(sel.sum())
    out.append({"lo": int(lo), "hi": int(hi), "n": n,
                "accuracy": float(correct[sel].mean()) if n else None})
  return out


QUERY = 0          # the query token of `value_recall` (the blank id: never a data token)
MARKER = 1         # the marker before the value (the separator id)


def value_recall(*, seed: int, stream: int, index: int, batch: int, length: int, vocab: int,
                 lags) -> dict:
  """Sparse lag recall: one value to hold across `lag` random distractors, for every lag.

  inputs[0] = MARKER, inputs[1] = v (a data token), then random data tokens (distractors,
  from the same alphabet as v), except a QUERY token at position 1 + lag for every lag in
  `lags`; the target there is v (mask 1 only at the query positions). So each sequence asks
  for the same value at every lag, each lag weighs the same, and the answer needs the memory
  of ONE token over `lag` steps of input that must be read but not kept (unlike
  `lag_recall_lags`, whose dense recall at lag k needs the k most recent tokens in order: a
  delay line that a readout of the form sum_tau K(t - tau) (C_t . B_tau) x_tau, with B, C
  functions of the local input only, cannot address beyond the conv window).
  """
  lags = np.asarray(lags, np.int64)
  if length < int(lags.max()) + 2:
    raise ValueError(f"value_recall: length {length} must be at least max(lags) + 2 = "
                     f"{int(lags.max()) + 2}")
  if len(set(lags.tolist())) != len(lags) or lags.min() < 1:
    raise ValueError(f"value_recall: lags must be distinct and >= 1, got {lags.tolist()}")
  rng = np.random.default_rng([seed, stream, index])
  inputs = rng.integers(FIRST, vocab, (batch, length)).astype(np.int32)
  inputs[:, 0] = MARKER
  value = inputs[:, 1]
  targets = np.zeros_like(inputs)
  mask = np.zeros((batch, length), np.float32)
  pos = 1 + lags
  inputs[:, pos] = QUERY
  targets[:, pos] = value[:, None]
  mask[:, pos] = 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def kv_recall(*, seed: int, stream: int, index: int, batch: int, length: int, vocab: int,
              num_pairs: int, power: float = 0.01) -> dict:
  """MQAR among distractors: `train.data.synthetic.mqar` (num_pairs key-value pairs at the
  start, each key queried once after a gap g drawn with p(g) ~ g^(power - 1), about uniform in
  log g for power near 0; the target at the query is the value) with every other position after
  the pairs a random token of the value alphabet instead of a blank.

  So the layer reads values everywhere (distractors, from the alphabet of the answers), and the
  answer at a gap g needs the pair remembered across g of them; the query is the key itself
  (keys appear nowhere else). Gaps per query: `mqar_gaps`. Same (seed, stream, index) and
  length: the same pairs and queries as mqar, the distractors drawn from their own stream.
  """
  out = synthetic.mqar(seed=seed, stream=stream, index=index, batch=batch, length=length,
                       vocab=vocab, num_pairs=num_pairs, power=power)
  half = (vocab - FIRST) // 2
  rng = np.random.default_rng([seed, stream, index, 1])
  fill = np.zeros((batch, length), bool)
  fill[:, 2 * num_pairs:] = True
  fill &= out["mask"] == 0
  distractors = (FIRST + half + rng.integers(0, half, (batch, length))).astype(np.int32)
  out["inputs"] = np.where(fill, distractors, out["inputs"])
  return out
