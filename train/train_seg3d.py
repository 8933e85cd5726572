"""Train a 3D segmenter (Pack3DSegmenter or the UNet3D baseline) on procedural cell volumes.

  python -m train.train_seg3d --config=configs/seg3d_cells.py --workdir=/tmp/seg3d \
      [--config.model.kind=unet3d --config.steps=100 ...]
Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host.
"""

from train import cli, seg3d_task

if __name__ == "__main__":
  cli.run(seg3d_task.train_and_evaluate)
