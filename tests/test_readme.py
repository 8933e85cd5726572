"""README.md's API section runs as a doctest (its code fences are dropped first)."""

import doctest
import pathlib

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def api_section() -> str:
  text = README.read_text()
  start = text.index("\n## API\n")
  end = text.index("\n## ", start + 1)
  return "\n".join(line for line in text[start:end].splitlines()
                   if not line.startswith("```"))


def test_readme_api_section_runs():
  test = doctest.DocTestParser().get_doctest(api_section(), {}, "README.md ## API",
                                             str(README), 0)
  assert test.examples, "the API section has no examples"
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  runner.run(test)
  assert runner.failures == 0, f"{runner.failures} README example(s) failed (output above)"
