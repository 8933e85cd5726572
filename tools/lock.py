"""Writes a constraints file: the exact version of every package (direct and transitive) that
`pip install -e '.[dev,docs,aot-tpu,aot-gpu]'` resolves to for one Python.

  python tools/lock.py --python=python3.12 --out=constraints/py312-jax012.txt
  python tools/lock.py --python=python3.11 --lowest --out=constraints/py311-jax010.txt

Default: the newest versions pyproject.toml's ranges admit on that Python. --lowest: every
range's lower bound pinned (`name>=X` -> `name==X`), the rest resolved around them; this is
the low end that `make test-lowest` proves. pip resolves without installing anything
(`--dry-run --ignore-installed --report`). Run it with any Python >= 3.11 (it reads
pyproject.toml with tomllib); `--python` is the interpreter whose environment is resolved.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXTRAS = "dev,docs,aot-tpu,aot-gpu"


def lower_bounds(pyproject: dict) -> list[str]:
  """`name==X` for every requirement in pyproject's dependencies and extras with `>=X`."""
  project = pyproject["project"]
  reqs = list(project["dependencies"])
  for extra in project["optional-dependencies"].values():
    reqs += extra
  pins = []
  for req in reqs:
    match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*([^;]*)", req)
    name, spec = match.group(1), match.group(3)
    low = re.search(r">=\s*([^,\s]+)", spec)
    if low:
      pins.append(f"{name}=={low.group(1)}")
  return pins


def resolve(python: str, constraints: list[str]) -> tuple[str, list[tuple[str, str]]]:
  """(python version, [(name, version)]) that pip would install, sorted by name."""
  with tempfile.TemporaryDirectory() as tmp:
    report, extra = pathlib.Path(tmp) / "report.json", []
    if constraints:
      (pathlib.Path(tmp) / "c.txt").write_text("\n".join(constraints) + "\n")
      extra = ["-c", str(pathlib.Path(tmp) / "c.txt")]
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                    "--report", str(report), *extra, "-e", f".[{EXTRAS}]"],
                   cwd=ROOT, check=True)
    data = json.loads(report.read_text())
  own = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
  got = sorted((item["metadata"]["name"], item["metadata"]["version"]) for item in data["install"]
               if item["metadata"]["name"] != own)
  version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                           check=True, capture_output=True, text=True).stdout.strip()
  return version, sorted(got, key=lambda nv: nv[0].lower())


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--python", required=True, help="interpreter to resolve for")
  parser.add_argument("--out", required=True, help="constraints file to write")
  parser.add_argument("--lowest", action="store_true", help="pin every lower bound")
  args = parser.parse_args(argv)
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  version, pins = resolve(args.python, lower_bounds(pyproject) if args.lowest else [])
  which = "lowest versions the ranges admit" if args.lowest else "newest versions the ranges admit"
  lines = [f"# Python {version}: the {which} in pyproject.toml, every package exact.",
           f"# Written by `python tools/lock.py{' --lowest' if args.lowest else ''} "
           f"--python=<python{version.rsplit('.', 1)[0]}> --out={args.out}`; do not edit by hand.",
           *(f"{name}=={v}" for name, v in pins)]
  pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
  print(f"{args.out}: {len(pins)} packages for Python {version}", file=sys.stderr)


if __name__ == "__main__":
  main()
