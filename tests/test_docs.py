"""The documentation site (docs/, `make docs`): it builds with no warning, every public symbol
is on it, and its pages' own examples run (what they include from README.md runs in
tests/test_readme.py)."""

import doctest
import importlib.util
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


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_page_examples_run(page):
  text = (DOCS / page).read_text()
  blocks = re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)
  test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, page, page, 0)
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  runner.run(test)
  assert runner.failures == 0, f"{runner.failures} example(s) on docs/{page} failed (above)"
