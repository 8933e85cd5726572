"""Sphinx configuration of the documentation site (`make docs`; DESIGN.md says why Sphinx).

The build is strict (`-W` in the Makefile and in .readthedocs.yaml, `nitpicky` here): a
warning, a cross-reference that resolves to nothing in this package, or a public symbol the
API reference leaves out (`_check_api_coverage` below) fails it. Pages are MyST Markdown; the
API reference is autodoc.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))            # experiments/, and a clone that is not installed
sys.path.insert(0, str(ROOT / "docs"))   # figures.py
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "neurips26-jax"
author = "the neurips26-jax authors"
release = importlib.import_module("neurips26_jax").__version__
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_generated"]   # _generated: included by results.md
html_theme = "furo"
nitpicky = True
html_title = "neurips26-jax"
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]
# Docstrings write `name` for code (Markdown's habit); in reST that is the default role.
default_role = "code"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
# What the signatures name from other libraries is not cross-referenced (no network at build
# time for intersphinx); every reference into this package must still resolve.
nitpick_ignore_regex = [("py:.*", r"(jax|jaxlib|flax|numpy|np|jnp|ml_collections|optax|typing"
                                  r"|collections|pathlib|os|types|builtins)(\..*)?"),
                        ("py:.*", r"(Array|ArrayLike|DTypeLike|Any|Callable|Sequence|Mapping"
                                  r"|Iterable|Iterator|Literal|Self|PathLike|Shape)")]

# The modules the API reference documents (docs/api.md has one automodule per entry).
API_MODULES = [
    "neurips26_jax", "neurips26_jax.models", "neurips26_jax.jaxops.flash_ffn",
    "neurips26_jax.jaxops.pack3d", "neurips26_jax.jaxops.frac", "neurips26_jax.jaxops.packing",
    "neurips26_jax.jaxops.rope", "neurips26_jax.jaxops.rms_norm",
    "neurips26_jax.pallas_kernels.flash_ffn", "neurips26_jax.pallas_kernels.pack3d_attention",
    "neurips26_jax.pallas_kernels.frac_scan", "neurips26_jax.train",
    "neurips26_jax.train.inference", "neurips26_jax.configs", "neurips26_jax.models.impl",
]


def public_symbols(module_name: str) -> dict[str, object]:
  """{full name: object} a module exports: its `__all__` where it has one, else the classes
  and functions it defines whose names do not start with "_"."""
  module = importlib.import_module(module_name)
  names = getattr(module, "__all__", None)
  if names is None:
    names = [n for n, obj in vars(module).items() if not n.startswith("_")
             and (inspect.isclass(obj) or inspect.isfunction(obj))
             and getattr(obj, "__module__", None) == module_name]
  return {f"{module_name}.{n}": getattr(module, n) for n in names}


def _check_api_coverage(app, env) -> None:
  """Every public symbol of `API_MODULES` is on the site (autodoc leaves out one without a
  docstring, silently): names the ones that are not."""
  documented = set(env.domaindata["py"]["objects"])
  missing = []
  for module in API_MODULES:
    for name, obj in public_symbols(module).items():
      if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        continue  # constants, type aliases, version: documented in their module's docstring
      home = f"{obj.__module__}.{obj.__qualname__}"
      if name not in documented and home not in documented:
        missing.append(name + ("" if inspect.getdoc(obj) else " (no docstring)"))
  if missing:
    from sphinx.errors import ExtensionError
    raise ExtensionError("the API reference lacks public symbols: " + ", ".join(missing))


_CODE = re.compile(r"(``.*?``|`[^`]*`)")


def _escape(text: str) -> str:
  """reST's markup characters in prose, outside `code`: *, | and a word-final _ are text."""
  parts = _CODE.split(text)
  for i in range(0, len(parts), 2):
    parts[i] = re.sub(r"([*|])", r"\\\1", parts[i])
    parts[i] = re.sub(r"(\w)_(?=\W|$)", r"\1\\_", parts[i])
  return "".join(parts)


def plain_to_rest(lines: list[str]) -> list[str]:
  """A docstring written for `help()` as reST: prose paragraphs stay prose (with `code`);
  every run of lines indented below its paragraph (shapes, formulas, option lists, doctests)
  becomes a literal block, laid out as written."""
  out, i = [], 0
  while i < len(lines):
    line = lines[i]
    if line.startswith(" ") and line.strip():
      block = []
      while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        block.append(lines[i])
        i += 1
      while block and not block[-1].strip():
        block.pop()
      last = next((o for o in reversed(out) if o.strip()), "")
      intro = [] if last.rstrip().endswith("::") else ["", "::"]
      out += intro + [""] + ["   " + b for b in block] + [""]
      continue
    out.append(_escape(line))
    i += 1
  return out


def _docstring(app, what, name, obj, options, lines) -> None:
  if name.startswith("neurips26_jax"):
    lines[:] = plain_to_rest(lines)


def _class_signature(app, what, name, obj, options, signature, return_annotation):
  """An NNX layer's own __init__ signature (autodoc reads flax's metaclass __call__, which
  takes *args, **kwargs)."""
  if what == "class" and signature == "(*args: Any, **kwargs: Any)":
    try:
      init = inspect.signature(obj.__init__, eval_str=True)
    except NameError:  # an annotation only importable under TYPE_CHECKING
      init = inspect.signature(obj.__init__)
    params = list(init.parameters.values())[1:]
    from sphinx.util.inspect import stringify_signature
    return stringify_signature(init.replace(parameters=params), show_return_annotation=False), None
  return None


def _figures(app) -> None:
  import figures  # docs/figures.py
  figures.render(pathlib.Path(app.srcdir) / "_generated")


def setup(app):
  app.connect("builder-inited", _figures)
  app.connect("autodoc-process-signature", _class_signature)
  app.connect("autodoc-process-docstring", _docstring)
  app.connect("env-check-consistency", _check_api_coverage)
