"""Train a byte-level language model.

  python -m train.train_lm --config=configs/lm_default.py --workdir=/tmp/lm \
      [--config.steps=100 --config.model.mixer=attention ...]
Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host.
"""

from absl import app, flags
from ml_collections import config_flags

from train import cli, lm_task

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")


def main(argv):
  del argv
  cli.initialize()
  lm_task.train_and_evaluate(_CONFIG.value, cli.workdir())


if __name__ == "__main__":
  app.run(main)
