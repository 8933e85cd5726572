"""Synthetic recall tasks: structure of MQAR, lag recall and selective copying batches."""

import numpy as np
import pytest

from neurips26_jax.train.data import synthetic

COMMON = dict(seed=0, stream=0, index=0, batch=6, length=64, vocab=40)


def check_pure(fn, **kwargs):
  a, b = fn(**COMMON, **kwargs), fn(**COMMON, **kwargs)
  for k in ("inputs", "targets", "mask"):
    np.testing.assert_array_equal(a[k], b[k])
    assert a[k].shape == (6, 64)
  assert not np.array_equal(a["inputs"], fn(**{**COMMON, "index": 1}, **kwargs)["inputs"])
  return a


def test_mqar_answers_are_the_values_of_the_queried_keys():
  d = check_pure(synthetic.mqar, num_pairs=8)
  for inp, tgt, mask in zip(d["inputs"], d["targets"], d["mask"]):
    pairs = dict(zip(inp[0:16:2], inp[1:16:2]))
    queried = np.flatnonzero(mask)
    assert len(queried) == 8 and queried.min() >= 16
    assert sorted(inp[queried]) == sorted(pairs)
    assert all(tgt[q] == pairs[inp[q]] for q in queried)


def test_mqar_gaps_follow_a_power_law():
  gaps = synthetic.power_law_gaps(np.random.default_rng(0), 20000, 1000, 0.01)
  assert gaps.min() >= 1 and gaps.max() <= 1000
  # p(g) ~ 1/g: each factor-of-10 band holds about the same mass
  bands = [np.mean((gaps >= lo) & (gaps < 10 * lo)) for lo in (1, 10, 100)]
  assert max(bands) / min(bands) < 1.6


def test_lag_recall_targets_are_the_input_lag_steps_back():
  d = check_pure(synthetic.lag_recall)
  lags = synthetic.log_spaced_lags(64)
  np.testing.assert_array_equal(lags, [1, 2, 4, 8, 16])
  for inp, tgt, mask in zip(d["inputs"], d["targets"], d["mask"]):
    lag = lags[inp[0] - synthetic.FIRST]
    t = np.flatnonzero(mask)
    assert t[0] == 1 + lag and t[-1] == 63
    np.testing.assert_array_equal(tgt[t], inp[t - lag])


def test_selective_copy_emits_the_scattered_tokens_in_order():
  d = check_pure(synthetic.selective_copy, num_tokens=6)
  for inp, tgt, mask in zip(d["inputs"], d["targets"], d["mask"]):
    data = inp[:58][inp[:58] >= synthetic.FIRST]
    assert len(data) == 6 and inp[58] == 1 and not inp[59:].any()
    np.testing.assert_array_equal(tgt[mask == 1], data)


@pytest.mark.parametrize("fn, kwargs, match", [
    (synthetic.mqar, {"num_pairs": 30}, "mqar"),
    (synthetic.selective_copy, {"num_tokens": 40}, "selective_copy"),
    (synthetic.lag_recall, {"vocab": 4}, "lag_recall")])
def test_errors(fn, kwargs, match):
  with pytest.raises(ValueError, match=match):
    fn(**{**COMMON, **kwargs})
