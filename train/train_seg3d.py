"""Train a 3D segmenter (Pack3DSegmenter or the UNet3D baseline) on procedural cell volumes.

  python -m train.train_seg3d --config=configs/seg3d_cells.py --workdir=/tmp/seg3d \
      [--config.model.kind=unet3d --config.steps=100 ...]
Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host.
"""

from absl import app, flags
from ml_collections import config_flags

from train import cli, seg3d_task

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config (configs/*.py).",
                                          lock_config=True)
flags.mark_flag_as_required("config")


def main(argv):
  del argv
  cli.initialize()
  seg3d_task.train_and_evaluate(_CONFIG.value, cli.workdir())


if __name__ == "__main__":
  app.run(main)
