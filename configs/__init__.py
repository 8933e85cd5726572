"""ml_collections configs, one file per experiment, each with `get_config([arg])`.

The binaries' --config takes a config's name (`--config=lm_smoke`, `--config=lm_paper:370m`)
or the path of a config file of your own (`--config=my_configs/big.py`).
"""

import pathlib
import runpy

_HERE = pathlib.Path(__file__).parent


def names() -> list[str]:
  """The packaged configs' names, e.g. ["exp_far3d", ..., "lm_default", ..., "seg3d_smoke"]."""
  return sorted(p.stem for p in _HERE.glob("*.py") if not p.stem.startswith("_"))


def resolve(spec: str) -> str:
  """--config's value -> a config file path: "lm_paper:370m" -> "<this folder>/lm_paper.py:370m";
  anything else (a path, with or without ":arg") is returned as given."""
  name, sep, arg = spec.partition(":")
  if name in names():
    return f"{_HERE / name}.py{sep}{arg}"
  return spec


def load(spec: str):
  """The ConfigDict --config's value names: "lm_paper:370m" -> lm_paper.get_config("370m"),
  "my/config.py" -> that file's get_config()."""
  path, _, arg = resolve(spec).partition(":")
  get_config = runpy.run_path(path).get("get_config")
  if get_config is None:
    raise ValueError(f"{path} defines no get_config(), the function a config file provides")
  return get_config(arg) if arg else get_config()
