"""Flags shared by the training binaries: --workdir and the multi-host coordinator flags."""

from absl import flags, logging

from train import sharding

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
