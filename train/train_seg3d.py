r"""Train a 3D segmenter (Pack3DSegmenter or the UNet3D baseline) on procedural cell volumes;
evaluate it afterwards.

  python -m train.train_seg3d --config=configs/seg3d_cells.py --workdir=runs/seg3d \
      [--config.model.kind=unet3d --config.steps=100 ...]    # train (rerun: resume)
  python -m train.train_seg3d --workdir=runs/seg3d --mode=eval [--step=N]   # loss and Dice
  python -m train.train_seg3d --config=configs/seg3d_cells.py --mode=config # the config fields

Every config field is set with --config.<field>=<value>; --mode=config prints them all, with
their values, in that form. Multi-host: add --coordinator_address=HOST:PORT --num_processes=N
--process_id=I on every host (--init_timeout_s bounds the wait for all of them).
"""

from absl import flags

from train import cli, seg3d_task

flags.adopt_module_key_flags(cli)

if __name__ == "__main__":
  cli.run(seg3d_task.train_and_evaluate)
