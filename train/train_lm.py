r"""Train a byte-level language model; evaluate it or sample from it afterwards.

  neurips26-train-lm --config=lm_default --workdir=runs/lm \
      [--config.steps=100 --config.model.mixer=frac ...]     # train (rerun: resume)
  neurips26-train-lm --workdir=runs/lm --mode=sample [--step=N]   # text from the model
  neurips26-train-lm --workdir=runs/lm --mode=eval [--step=N]     # validation loss
  neurips26-train-lm --config=lm_default --mode=config            # list the config fields

`python -m neurips26_jax.train.train_lm` is the same binary. --config names a packaged config
(neurips26_jax/configs: lm_default, lm_smoke, lm_mqar, lm_paper:<size>, ...) or a config file
of your own. Every config field is set with --config.<field>=<value>; --mode=config prints them
all, with their values, in that form. Multi-host: add --coordinator_address=HOST:PORT
--num_processes=N --process_id=I on every host (--init_timeout_s bounds the wait for all).
"""

from absl import flags

from neurips26_jax.train import cli, lm_task

flags.adopt_module_key_flags(cli)


def main() -> None:
  """The console script `neurips26-train-lm`."""
  cli.run(lm_task.train_and_evaluate, sample=lm_task.sample)


if __name__ == "__main__":
  main()
