"""Every Python file of the project compiles on the interpreter running the suite: `make
test-lowest` runs it on Python 3.11, which refuses 3.12-only syntax (quotes or backslashes
inside f-string expressions) in modules no other test imports (scripts for a GPU, tools)."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("benchmarks", "configs", "experiments", "jaxops", "models", "pallas_kernels",
           "tests", "tools", "train", "data")
FILES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_project_has_files_to_check():
  assert len(FILES) > 100


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compiles(path):
  compile(path.read_text(), str(path), "exec")
