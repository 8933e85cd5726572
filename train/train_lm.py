r"""Train a byte-level language model; evaluate it or sample from it afterwards.

  python -m train.train_lm --config=configs/lm_default.py --workdir=runs/lm \
      [--config.steps=100 --config.model.mixer=frac ...]     # train (rerun: resume)
  python -m train.train_lm --workdir=runs/lm --mode=sample [--step=N]   # text from the model
  python -m train.train_lm --workdir=runs/lm --mode=eval [--step=N]     # validation loss
  python -m train.train_lm --config=configs/lm_default.py --mode=config # list the config fields

Every config field is set with --config.<field>=<value>; --mode=config prints them all, with
their values, in that form. Multi-host: add --coordinator_address=HOST:PORT --num_processes=N
--process_id=I on every host (--init_timeout_s bounds the wait for all of them).
"""

from absl import flags

from train import cli, lm_task

flags.adopt_module_key_flags(cli)

if __name__ == "__main__":
  cli.run(lm_task.train_and_evaluate, sample=lm_task.sample)
