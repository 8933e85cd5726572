"""What every training binary shares: --config, --workdir, the multi-host flags, `run`.

Bad input ends a binary with one line on stderr, `error: ...`, naming the flag or config field,
its value and what was expected, and exit status 2: flag and config-override parse errors, an
unknown config field, a missing config file, an unwritable workdir (checked before anything
slow), multi-host flags that do not fit together, and every train.errors.UsageError the config
checks raise. A run stopped on purpose (train.errors.TrainingError: non-finite values) prints its
message with status 1. Everything else is a bug and keeps its traceback.

SIGTERM and SIGINT end the binary with status 0 and no traceback: inside the training loop
after saving the step under way (train.trainer.fit), before or after it at once (nothing to save).
"""

import re
import runpy
import signal
import sys
from typing import Callable

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from train import errors, sharding, trainer

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.",
                               required=True)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "host:port of process 0 for multi-host runs (empty: one host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (hosts).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, N).")


def _fail(message: str, status: int = 2):
  sys.stderr.write(f"error: {message}\n")
  sys.exit(status)


def _unknown_field(argv: list[str]) -> str:
  """Which --config.<path>=... override names no field of the config file, in words."""
  config_file = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  config = runpy.run_path(config_file)["get_config"]()
  for override in re.findall(r"^--config\.([^=]+)", "\n".join(argv), re.M):
    node, parts = config, override.split(".")
    for i, key in enumerate(parts):
      where = ".".join(["config", *parts[:i]])
      if not isinstance(node, ConfigDict) or key not in node:
        known = sorted(node.keys()) if isinstance(node, ConfigDict) else "none (not a ConfigDict)"
        return (f"--config.{override}: {config_file} has no field {where}.{key}; "
                f"the fields of {where} are {known}")
      node = node[key]
  return ""


def _config_file_error(error: OSError) -> str:
  """ml_collections' multi-line load error -> `--config=FILE: <its last line>`."""
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  return f"--config={flags.FLAGS['config'].config_filename}: cannot load it ({lines[-1]})"


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors instead of usage dumps and chained tracebacks."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e))
  except (AttributeError, KeyError) as e:      # ml_collections: an override of a missing field
    _fail(_unknown_field(argv) or f"bad --config override: {e}")
  except OSError as e:                          # ml_collections: the config file cannot be read
    _fail(_config_file_error(e))


def check_flags(argv: list[str]) -> None:
  """UsageError for leftover positional arguments and multi-host flags that do not fit."""
  if len(argv) > 1:
    raise errors.UsageError(f"unexpected arguments {argv[1:]}: flags take the form --name=value")
  n, i = _NUM_PROCESSES.value, _PROCESS_ID.value
  if not _COORDINATOR.value:
    if n is not None or i is not None:
      raise errors.UsageError("--num_processes/--process_id need --coordinator_address=HOST:PORT")
    return
  if not re.fullmatch(r"[^:\s]+:\d+", _COORDINATOR.value):
    raise errors.UsageError(f"--coordinator_address={_COORDINATOR.value}: expected HOST:PORT")
  if n is None or n < 1:
    raise errors.UsageError(f"--num_processes={n}: expected a positive int with a coordinator")
  if i is None or not 0 <= i < n:
    raise errors.UsageError(f"--process_id={i}: expected an int in [0, {n})")


def initialize() -> None:
  """Quiet library logging; jax.distributed.initialize when --coordinator_address is given."""
  logging.set_verbosity(logging.WARNING)
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)


def workdir() -> str:
  return _WORKDIR.value


def run(train_and_evaluate: Callable) -> None:
  """The binary's main: parse flags, check them and the workdir, initialize,
  train_and_evaluate(config, workdir); errors as described in the module docstring."""

  def main(argv):
    # outside fit's own handlers, SIGTERM raises KeyboardInterrupt like SIGINT (caught below)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
      try:
        config = _CONFIG.value
        config.keys()                         # a config file that failed to load raises here
      except OSError as e:
        raise errors.UsageError(_config_file_error(e)) from None
      check_flags(argv)
      trainer.prepare_workdir(workdir())       # fails in a second, before any compiling
      initialize()
      train_and_evaluate(config, workdir())
    except errors.UsageError as e:
      _fail(str(e))
    except errors.TrainingError as e:
      _fail(str(e), status=1)
    except KeyboardInterrupt:            # outside the training loop, or a second signal in it
      sys.stderr.write("interrupted: stopped without saving; the checkpoints in --workdir are "
                       "complete, rerun to resume from the newest\n")

  app.run(main, flags_parser=_parse_flags)
