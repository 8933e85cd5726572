"""README.md's sections with examples run as doctests (their code fences are dropped first):
the API, and the way from a training run's workdir back to its model."""

import doctest
import pathlib

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ["## In your project", "## API", "### FlashFFN in your NNX block", "### Pack3D on a raw volume",
            "### Any layer in Linen", "### From a workdir back to the model"]


def section(title: str) -> str:
  """The text under `title` up to the next heading of any level."""
  text = README.read_text()
  start = text.index(f"\n{title}\n")
  end = text.index("\n#", start + 1)
  return "\n".join(line for line in text[start:end].splitlines()
                   if not line.startswith("```"))


@pytest.mark.parametrize("title", SECTIONS)
def test_readme_section_runs(title):
  test = doctest.DocTestParser().get_doctest(section(title), {}, f"README.md {title}",
                                             str(README), 0)
  assert test.examples, f"{title} has no examples"
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  runner.run(test)
  assert runner.failures == 0, f"{runner.failures} README example(s) failed (output above)"
