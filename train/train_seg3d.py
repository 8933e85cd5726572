r"""Train a 3D segmenter (Pack3DSegmenter or the UNet3D baseline) on procedural cell volumes;
evaluate it afterwards.

  neurips26-train-seg3d --config=seg3d_cells --workdir=runs/seg3d \
      [--config.model.kind=unet3d --config.steps=100 ...]    # train (rerun: resume)
  neurips26-train-seg3d --workdir=runs/seg3d --mode=eval [--step=N]   # loss and Dice
  neurips26-train-seg3d --config=seg3d_cells --mode=config            # the config fields

`python -m neurips26_jax.train.train_seg3d` is the same binary. --config names a packaged
config (seg3d_cells, seg3d_smoke, ...) or a config file of your own. Every config field is set
with --config.<field>=<value>; --mode=config prints them all, with their values, in that form.
Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host
(--init_timeout_s bounds the wait for all of them).
"""

from absl import flags

from neurips26_jax.train import cli, seg3d_task

flags.adopt_module_key_flags(cli)


def main() -> None:
  """The console script `neurips26-train-seg3d`."""
  cli.run(seg3d_task.train_and_evaluate)


if __name__ == "__main__":
  main()
