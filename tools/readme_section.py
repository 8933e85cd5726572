"""Rewrites the generated part of a markdown file: the text between a pair of marker comments
(`<!-- name:begin -->` ... `<!-- name:end -->`), which the table-writing commands own."""

from __future__ import annotations

import pathlib


def replace_section(path: pathlib.Path, begin: str, end: str, body: str) -> None:
  """Puts `body` between the markers `begin` and `end` of the file at `path` (the rest of the
  file unchanged); SystemExit naming the file and markers when they are missing."""
  text = path.read_text()
  if begin not in text or end not in text.split(begin, 1)[1]:
    raise SystemExit(f"{path} has no {begin} ... {end} section")
  head, rest = text.split(begin, 1)
  path.write_text(f"{head}{begin}\n{body}\n{end}{rest.split(end, 1)[1]}")
