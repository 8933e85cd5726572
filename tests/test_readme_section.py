"""tools.readme_section: the generated part of a markdown file between its markers."""

import pytest

from tools.readme_section import replace_section


def test_replaces_only_between_the_markers(tmp_path):
  path = tmp_path / "README.md"
  path.write_text("intro\n<!-- t:begin -->\nold\n<!-- t:end -->\nafter <!-- t:end -->\n")
  replace_section(path, "<!-- t:begin -->", "<!-- t:end -->", "new | table")
  assert path.read_text() == ("intro\n<!-- t:begin -->\nnew | table\n<!-- t:end -->\n"
                              "after <!-- t:end -->\n")


def test_missing_markers_name_the_file(tmp_path):
  path = tmp_path / "README.md"
  path.write_text("no markers\n")
  with pytest.raises(SystemExit, match="README.md has no <!-- t:begin --> ... <!-- t:end -->"):
    replace_section(path, "<!-- t:begin -->", "<!-- t:end -->", "x")
