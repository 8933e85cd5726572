"""The documentation site (docs/, `make docs`): it builds with no warning, every public symbol
is on it, and its pages' own examples run (what they include from README.md runs in
tests/test_readme.py)."""

import doctest
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import types

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
_needs_sphinx = pytest.mark.skipif(importlib.util.find_spec("sphinx") is None,
                                   reason="the docs extra is not installed (make docs installs it)")


def _conf():
  spec = importlib.util.spec_from_file_location("docs_conf", DOCS / "conf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@_needs_sphinx
def test_site_builds_without_a_warning(tmp_path):
  out = subprocess.run([sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q",
                        "-b", "html", str(DOCS), str(tmp_path)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  api = (tmp_path / "api.html").read_text()
  for name in ("neurips26_jax.models.FlashFFN", "neurips26_jax.jaxops.frac.frac_scan",
               "neurips26_jax.pallas_kernels.pack3d_attention.pack3d_attention",
               "neurips26_jax.train.inference.load_model"):
    assert f'id="{name}"' in api


@_needs_sphinx
def test_a_public_symbol_left_off_the_site_fails_the_build():
  conf = _conf()
  documented = (set().union(*map(conf.public_symbols, conf.API_MODULES))
                - {"neurips26_jax.jaxops.frac.frac_step"})
  env = types.SimpleNamespace(domaindata={"py": {"objects": dict.fromkeys(documented)}})
  with pytest.raises(Exception, match=r"lacks public symbols: neurips26_jax\.jaxops\.frac\.frac_step$"):
    conf._check_api_coverage(None, env)


def test_docstrings_become_rest_that_keeps_their_layout():
  conf = _conf()
  lines = ["Shapes, with a *star* and a_ word:", "", "  q [B, L, H, d_h]   *   |x|",
           "    continued", "", "Prose with `code*` stays code."]
  assert conf.plain_to_rest(lines) == [
      r"Shapes, with a \*star\* and a\_ word:", "", "", "::", "",
      "     q [B, L, H, d_h]   *   |x|", "       continued", "",
      "Prose with `code*` stays code."]


def _figures():
  spec = importlib.util.spec_from_file_location("docs_figures", DOCS / "figures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_results_are_computed_from_the_records():
  """The Results page's rows come from the json records: a kernel's ratio is the baseline's
  cycles over its own, only where both compiled; a quality row is the per-seed paired
  difference at each arm's best rate; a step row is relative to attention + SwiGLU."""
  figures = _figures()
  perf = [dict(program="frac/kernel", target="tpu-v5e", direction="fwd", dtype="bfloat16",
               status="ok", cycles=100),
          dict(program="frac/xla", target="tpu-v5e", direction="fwd", dtype="bfloat16",
               status="ok", cycles=250),
          dict(program="frac/kernel", target="tpu-v6e", direction="fwd", dtype="bfloat16",
               status="ok", cycles=100),
          dict(program="frac/xla", target="tpu-v6e", direction="fwd", dtype="bfloat16",
               status="crashed")]
  [row] = figures.speed_rows(perf)
  assert (row["target"], row["ratio"]) == ("tpu-v5e", 2.5)
  run = lambda arm, lr, seed, loss: (f"{arm}@{lr}/{seed}", dict(arm=arm, lr=lr, seed=seed,
                                                                 params=1, val_loss_whole=loss))
  runs = dict([run("swiglu", 1e-3, 0, 1.0), run("swiglu", 2e-3, 0, 0.9),
               run("swiglu", 2e-3, 1, 0.8), run("ffn", 1e-3, 0, 0.7), run("ffn", 2e-3, 0, 0.95),
               run("ffn", 1e-3, 1, 0.6)])
  [q] = figures.quality_rows({"x": {"meta": {"lrs": [1e-3, 2e-3]}, "runs": runs}})
  assert (q["arm"], q["lr"], q["seeds"]) == ("ffn", "0.001", 2)
  assert q["mean"] == pytest.approx(((0.7 - 0.9) + (0.6 - 0.8)) / 2)
  base = dict(config="c:125m", mixer="attention", ffn="swiglu", context=8, step_ms=[10, 20])
  other = dict(base, mixer="frac", step_ms=[15, 20])
  assert [r["vs_base"] for r in figures.step_rows([base, other])] == [[1.0, 1.0], [1.5, 1.0]]
  recorded = json.loads(figures.PERF.read_text())
  assert len(figures.speed_rows(recorded)) >= 20   # the recorded pairs are all found


def test_readme_summary_rows_match_their_records():
  """README's computed summary rows are what the records give today (rewrite them with
  `python docs/figures.py --readme` after a benchmark writes a new record)."""
  figures = _figures()
  text = figures.README.read_text()
  block = text.split(figures.BEGIN, 1)[1].split(figures.END, 1)[0].strip()
  assert block == figures.readme_rows()


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_page_examples_run(page):
  text = (DOCS / page).read_text()
  blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
  test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, page, page, 0)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  runner.run(test)
  assert runner.failures == 0, f"{runner.failures} example(s) on docs/{page} failed (above)"
