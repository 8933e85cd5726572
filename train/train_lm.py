"""Train a byte-level language model.

  python -m train.train_lm --config=configs/lm_default.py --workdir=/tmp/lm \
      [--config.steps=100 --config.model.mixer=attention ...]
Multi-host: add --coordinator_address=HOST:PORT --num_processes=N --process_id=I on every host.
"""

from train import cli, lm_task

if __name__ == "__main__":
  cli.run(lm_task.train_and_evaluate)
