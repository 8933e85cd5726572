"""What every training binary shares: --config, --workdir, the multi-host flags, `run`."""

from typing import Callable

from absl import app, flags, logging
from ml_collections import config_flags

from train import sharding

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")

_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.",
                               required=True)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "host:port of process 0 for multi-host runs (empty: one host).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes (hosts).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index in [0, N).")


def initialize() -> None:
  """Quiet library logging; jax.distributed.initialize when --coordinator_address is given."""
  logging.set_verbosity(logging.WARNING)
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)


def workdir() -> str:
  return _WORKDIR.value


def run(train_and_evaluate: Callable) -> None:
  """The binary's main: parse flags, initialize, train_and_evaluate(config, workdir)."""

  def main(argv):
    del argv
    initialize()
    train_and_evaluate(_CONFIG.value, workdir())

  app.run(main)
