"""The kinds of error a training binary reports as one sentence instead of a traceback.

`train.cli.run` prints the message alone on stderr and exits with status 2 (UsageError) or 1
(TrainingError, StartupError); any other exception is a bug and keeps its traceback.
"""


class UsageError(ValueError):
  """Bad input from the user: a config field, a flag, the data path or the workdir.

  The message names the field or flag, the value given and what was expected.
  """


class TrainingError(RuntimeError):
  """The run stopped on purpose; the message says why, at which step, and what is kept."""


class StartupError(RuntimeError):
  """A multi-host run could not start: processes missing or misconfigured (train.distributed)."""
