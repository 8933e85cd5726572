"""Byte-level text data: the stdlib corpus, the split, batches as pure functions of the step."""

import numpy as np
import pytest

from neurips26_jax.train.data import text


def test_stdlib_corpus_is_python_source_and_deterministic():
  files = text.stdlib_files()
  assert files == sorted(files) and len(files) > 100
  assert not any("site-packages" in f.parts or "test" in f.parts[:-1] for f in files)
  a = text.load_corpus(max_bytes=50_000)
  assert a.dtype == np.uint8 and len(a) == 50_000
  np.testing.assert_array_equal(a, text.load_corpus(max_bytes=50_000))
  assert b"def " in a.tobytes()


def test_windows_are_a_pure_function_of_seed_stream_index(tmp_path):
  path = tmp_path / "t.txt"
  path.write_bytes(bytes(range(256)) * 40)
  train, val = text.split(text.load_corpus(str(path)), 0.1)
  assert len(train) + len(val) == 256 * 40
  w = lambda **k: text.windows(train, batch=4, length=16, **{"seed": 0, "stream": text.TRAIN,
                                                               "index": 3, **k})
  np.testing.assert_array_equal(w(), w())
  assert w().shape == (4, 17) and w().dtype == np.int32
  assert not np.array_equal(w(), w(index=4)) and not np.array_equal(w(), w(seed=1))
  assert not np.array_equal(w(), w(stream=text.VAL))
  np.testing.assert_array_equal(np.diff(w()) % 256, 1)       # contiguous bytes


@pytest.mark.parametrize("call, match", [
    (lambda: text.load_corpus("/no/such/file"), "path"),
    (lambda: text.split(np.zeros(10, np.uint8), 1.5), "val_fraction"),
    (lambda: text.windows(np.zeros(5, np.uint8), seed=0, stream=0, index=0, batch=1, length=8),
     "window")])
def test_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()
