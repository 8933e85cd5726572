"""libtpu's static cycle estimate of a compiled program, per HLO op and in total.

A deviceless TPU compile with `--xla_jf_dump_static_llo_profile_to=DIR` in LIBTPU_INIT_ARGS
writes one `<op>_<chip>_static_llo_profile.textproto` per HLO op of the entry computation and
of every while-loop body, holding `hlo_op_name` and `estimated_cycles` (loops inside a Pallas
kernel and DMA latency are in the figure). An XLA while loop's body is listed once: its ops
count trip-count times, read here from the optimized HLO (`compiled.as_text()`). The figure is
a static schedule, not a timing, and is optimistic for memory-bound code (benchmarks/README.md,
"TPU speed: libtpu's static estimate", says how to read it and what it leaves out).
"""

from __future__ import annotations

import pathlib
import re

_OP = re.compile(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_WHILE = re.compile(r" while\(.*condition=%([\w.\-]+), body=%([\w.\-]+)")
_BOUND = re.compile(r"s32\[\][^=]*constant\((-?\d+)\)")


def read_profile(directory: pathlib.Path) -> dict[str, int]:
  """{HLO op name: estimated cycles} from one compile's profile files."""
  cycles: dict[str, int] = {}
  for path in pathlib.Path(directory).glob("*static_llo_profile.textproto"):
    for name, value in _OP.findall(path.read_text()):
      cycles[name] = cycles.get(name, 0) + int(value)
  return cycles


def _computations(hlo: str) -> tuple[dict[str, str], dict[str, list[str]], str]:
  """(instruction -> its computation, computation -> its lines, the entry's name)."""
  owner, lines, current, entry = {}, {}, None, ""
  for line in hlo.splitlines():
    if (match := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
      current = match.group(1)
      lines[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      if line.strip() == "}":
        current = None
        continue
      lines[current].append(line)
      if match := _INSTRUCTION.match(line):
        owner[match.group(1)] = current
  return owner, lines, entry


def trip_count(condition_lines: list[str]) -> int:
  """A counted loop's trip count from its condition: the s32 bound its induction variable is
  compared with (jax's fori_loop / scan / map count up from 0 to the bound)."""
  bounds = [int(b) for line in condition_lines for b in _BOUND.findall(line)]
  if len(bounds) != 1:
    raise ValueError(f"static_profile: cannot read a trip count from a loop condition with "
                     f"{len(bounds)} s32 constants: {condition_lines}")
  return bounds[0]


def multipliers(hlo: str) -> dict[str, int]:
  """{instruction: how many times it runs}: 1 in the entry, times each enclosing while
  loop's trip count."""
  owner, lines, entry = _computations(hlo)
  weight = {entry: 1}
  pending = [entry]
  while pending:
    computation = pending.pop()
    for line in lines.get(computation, []):
      if match := _WHILE.search(line):
        condition, body = match.groups()
        weight[body] = weight[computation] * trip_count(lines[condition])
        pending.append(body)
  return {name: weight[comp] for name, comp in owner.items() if comp in weight}


def total_cycles(cycles: dict[str, int], hlo: str) -> tuple[int, dict[str, int]]:
  """(the program's estimated cycles, each op's cycles times its run count)."""
  runs = multipliers(hlo)
  weighted = {name: value * runs.get(name, 1) for name, value in cycles.items()}
  return sum(weighted.values()), weighted
