"""The package as a user gets it: the wheel built from this tree, installed without the
repository on the path, used from a project of the user's own that has its own `models/`,
`train/` and `configs/` first on sys.path.

One wheel for the module (built from a copy of the tree, so the clone stays clean); each
test runs a fresh interpreter with PYTHONPATH = <user project>:<install dir>:<the venv's
site-packages> under -S, so the clone's editable install (a .pth file) is not in play.
"""

import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SOURCES = ["pyproject.toml", "README.md", "DESIGN.md", "neurips26_jax",
           *PROJECT["tool"]["setuptools"]["package-dir"].values()]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(install dir, user project dir): the wheel installed with `pip --target`, and a user
  project whose own models/, train/, configs/ packages say `OWNER = "user"`."""
  root = tmp_path_factory.mktemp("installed")
  tree = root / "tree"
  for name in dict.fromkeys(SOURCES):
    source = REPO / name
    if source.is_dir():
      shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      (tree / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy(source, tree / name)           # follows the DESIGN.md link, as the build does
  pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist",
                  tree], check=True, capture_output=True)
  [wheel] = (root / "dist").glob("*.whl")
  target = root / "site"
  subprocess.run([*pip, "install", "--no-deps", "--target", target, wheel], check=True,
                 capture_output=True)
  user = root / "user_project"
  for package in ("models", "train", "configs"):
    (user / package).mkdir(parents=True)
    (user / package / "__init__.py").write_text('OWNER = "user"\n')
  return target, user


def _run(installed, *args, cwd=None, timeout=300) -> subprocess.CompletedProcess:
  """A command in the user project (or `cwd`), seeing the installed package and the venv's
  libraries, not the clone."""
  target, user = installed
  path = os.pathsep.join([str(user), str(target), sysconfig.get_paths()["purelib"]])
  return subprocess.run(args, cwd=cwd or user, capture_output=True, text=True, timeout=timeout,
                        env={**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"})


def _ok(out: subprocess.CompletedProcess) -> str:
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _python(installed, code: str) -> str:
  return _ok(_run(installed, sys.executable, "-S", "-c", code))


def _train_lm(installed, *flags, cwd=None) -> subprocess.CompletedProcess:
  """The console script, run by the venv's Python under -S (its shebang would add the .pth)."""
  target, _ = installed
  return _run(installed, sys.executable, "-S", str(target / "bin" / "neurips26-train-lm"),
              *flags, cwd=cwd)


def test_only_the_namespace_is_installed(installed):
  target, _ = installed
  version = PROJECT["project"]["version"]
  assert sorted(p.name for p in target.iterdir()) == [
      "bin", "neurips26_jax", f"neurips26_jax-{version}.dist-info"]
  assert sorted(p.name for p in (target / "bin").iterdir()) == [
      "neurips26-train-lm", "neurips26-train-seg3d"]
  package = target / "neurips26_jax"
  assert (package / "py.typed").is_file()
  design = package / "DESIGN.md"
  assert not design.is_symlink() and design.read_text() == (REPO / "DESIGN.md").read_text()


def test_every_package_folder_is_in_the_wheel(installed):
  """A subpackage missing from pyproject's list would be missing from every install."""
  target, _ = installed
  for package, folder in PROJECT["tool"]["setuptools"]["package-dir"].items():
    for init in (REPO / folder).rglob("__init__.py"):
      assert target.joinpath(*package.split("."), init.relative_to(REPO / folder)).is_file(), init


def test_imports_through_the_namespace_beside_the_users_packages(installed):
  target, _ = installed
  out = _python(installed, """
import models, train, configs
import neurips26_jax
from neurips26_jax import FlashFFN, FRACMixer, LanguageModel, Pack3DAttention
from neurips26_jax.train import lm_task
print(models.OWNER, train.OWNER, configs.OWNER)
print(neurips26_jax.__version__)
print(FlashFFN.__module__, lm_task.__file__)
""").split("\n")
  assert out[0] == "user user user"
  assert out[1] == PROJECT["project"]["version"]
  module, path = out[2].split()
  assert module == "neurips26_jax.models.flash_ffn"
  assert pathlib.Path(path).is_relative_to(target), path


def test_console_script_trains_a_packaged_config_and_the_workdir_loads_back(installed):
  _, user = installed
  (user / "corpus.txt").write_text("the user's own text, a few words. " * 400)
  _ok(_train_lm(installed, "--config=lm_smoke", "--config.steps=2",
                "--config.data.path=corpus.txt", "--workdir=runs/smoke"))
  saved = json.loads((user / "runs/smoke/config.json").read_text())
  assert saved["data"]["path"] == str(user / "corpus.txt")       # absolute: loads from anywhere
  assert "checkpoint 2 of" in _ok(_train_lm(installed, "--workdir=smoke", "--mode=eval",
                                            cwd=user / "runs"))
  out = _python(installed, """
from neurips26_jax import train
model, config = train.load_model("runs/smoke")
print(type(model).__name__, config.steps)
""")
  assert out.split() == ["LanguageModel", "2"]


def test_a_config_path_that_is_not_there_is_one_line(installed):
  """The README's clone-relative path, from a user's project, with and without an override."""
  for overrides in ([], ["--config.data.path=x.txt"]):
    out = _train_lm(installed, "--config=configs/lm_default.py", *overrides, "--workdir=runs/x")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("error: --config=configs/lm_default.py: no such config file")
    assert "--config=lm_default" in out.stderr


# Names in docstrings that look like paths but are no file of this project: run outputs,
# examples of a user's own file, another project's module.
NOT_OURS = {"workdir/config.json", "workdir/metrics.jsonl", "my/config.py", "my_configs/big.py",
            "mamba_ssm/modules/mamba2.py"}
CITATION = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.(?:py|md|json|jsonl)|[\w-]+\.md)\b")


def test_what_the_docstrings_cite_is_installed(installed):
  """`help(...)` in an install: a file a docstring cites is in the package, or is said to be
  the repository's (benchmarks, results and tests are not installed)."""
  target, _ = installed
  package = target / "neurips26_jax"
  missing = []
  for source in package.rglob("*.py"):
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
        continue
      doc = ast.get_docstring(node) or ""
      for match in CITATION.finditer(doc):
        cited = match[1].removeprefix("neurips26_jax/")
        said = " ".join(doc[max(0, match.start() - 20):match.start()].replace("`", "").split())
        if (cited in NOT_OURS or said.endswith("the repository's")
            or (package / cited).exists() or (source.parent / cited).exists()):
          continue
        missing.append(f"{source.relative_to(target)}: {cited}")
  assert not missing, missing
