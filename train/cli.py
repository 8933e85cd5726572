"""What every training binary shares: its flags, the modes, and `run`, its main.

Modes (--mode): `train` (the default) trains --config in --workdir, resuming from its newest
checkpoint; `eval` and `sample` (language models) load a run's model from --workdir
(train.inference: its config.json and the newest checkpoint, or --step) and print the
evaluation metrics or a generated sample, writing nothing; `config` prints every field of
--config, with the command's overrides, as the --config.<field>=<value> flags that set it.
In eval and sample modes the config is the run's own, with this command's --config.<field>
overrides applied when --config is given (e.g. --config.sample.num_tokens=200).

Bad input ends a binary with one line on stderr, `error: ...`, naming the flag or config field,
its value and what was expected, and exit status 2: flag and config-override parse errors (an
unknown flag that is a config field says to write --config.<field>), an unknown config field, a
missing config file, an unwritable workdir (checked before anything slow), multi-host flags
that do not fit together, and every train.errors.UsageError the config checks raise. A run
stopped on purpose (train.errors.TrainingError: non-finite values) prints its message with
status 1, and so does a multi-host start that does not complete within --init_timeout_s
(train.errors.StartupError, naming the missing processes; train.distributed). Everything else
is a bug and keeps its traceback.

SIGTERM and SIGINT end the binary with status 0 and no traceback: inside the training loop
after saving the step under way (train.trainer.fit), before or after it at once (nothing to save),
also while waiting for the other processes of a multi-host run.
"""

import os
import re
import signal
import sys
from typing import Callable

import jax
from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

from neurips26_jax import configs
from neurips26_jax.train import distributed, errors, inference, trainer

MODES = ("train", "eval", "sample", "config")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: a packaged config's name (lm_default, lm_smoke, "
    "lm_paper:370m, seg3d_cells, ...) or a config file of your own; override any field with "
    "--config.<field>=<value> (--mode=config lists them). Required to train; in eval and "
    "sample modes only needed for overrides.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and plots (train); the run to load "
    "(eval, sample). Rerunning with the same --workdir resumes.")
_MODE = flags.DEFINE_enum(
    "mode", "train", MODES, "train: train --config in --workdir. eval: the evaluation loss of "
    "--workdir's model. sample: text from --workdir's language model. config: print every "
    "config field as a --config.<field>=<value> flag.")
_STEP = flags.DEFINE_integer(
    "step", None, "eval and sample modes: the checkpoint step to load (default: the newest).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", "", "Multi-host: HOST:PORT of process 0, the same on every process "
    "(empty: one process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Multi-host: the number of processes (hosts).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "Multi-host: this process's index in [0, --num_processes).")
_INIT_TIMEOUT_S = flags.DEFINE_float(
    "init_timeout_s", 300.0, "Multi-host: seconds every process waits at start-up for all "
    "--num_processes processes to reach the coordinator; then each exits with one line "
    "naming the missing ones.", lower_bound=0.0)


def _fail(message: str, status: int = 2):
  sys.stderr.write(f"error: {message}\n")
  sys.exit(status)


def _config_spec(argv: list[str]) -> str:
  """--config's value as given ("" without one)."""
  return next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")


def _with_packaged_configs(argv: list[str]) -> list[str]:
  """--config=NAME[:arg] naming a packaged config -> its file. UsageError for a file that is
  not there or a config that does not load (before ml_collections, which would raise from
  inside flag parsing)."""
  given = _config_spec(argv)
  argv = [a if not a.startswith("--config=") else "--config=" + configs.resolve(a[9:])
          for a in argv]
  spec = _config_spec(argv)
  if not spec:
    return argv
  if not os.path.isfile(spec.partition(":")[0]):
    raise errors.UsageError(
        f"--config={given.partition(':')[0]}: no such config file; a packaged config is named "
        f"without a path or .py (--config=lm_default), one of {', '.join(configs.names())}")
  try:
    configs.load(spec)
  except Exception as e:  # noqa: BLE001  (the user's file: any error in it is bad input)
    last = (str(e).strip().splitlines() or [""])[-1]
    raise errors.UsageError(f"--config={given}: loading it raised {type(e).__name__}: "
                            f"{last}") from None
  return argv


def _unknown_field(argv: list[str]) -> str:
  """Which --config.<path>=... override names no field of the config file, in words."""
  config_file = _config_spec(argv)
  config = configs.load(config_file)
  for override in re.findall(r"^--config\.([^=]+)", "\n".join(argv), re.M):
    node, parts = config, override.split(".")
    for i, key in enumerate(parts):
      where = ".".join(["config", *parts[:i]])
      if not isinstance(node, ConfigDict) or key not in node:
        known = sorted(node.keys()) if isinstance(node, ConfigDict) else "none (not a ConfigDict)"
        return (f"--config.{override}: {config_file} has no field {where}.{key}; "
                f"the fields of {where} are {known}")
      node = node[key]
  return ""


def _unknown_flag(error: flags.UnrecognizedFlagError, argv: list[str]) -> str:
  """absl's unknown-flag error, with where the flag's name is a config field: --config.<name>."""
  name, given = error.flagname, str(error.flagvalue or f"--{error.flagname}")
  value = given.split("=", 1)[1] if "=" in given else "..."
  config_file = _config_spec(argv)
  if name.startswith("config.") and not config_file:
    return (f"{given} overrides a field of a config, but no --config was given: "
            "add the experiment's config (e.g. --config=lm_default; in eval and "
            "sample modes the one the run was trained with, whose saved fields the "
            "overrides then replace)")
  try:
    config = configs.load(config_file) if config_file else None
  except Exception:  # noqa: BLE001  (the hint is optional; the error stands without it)
    config = None
  node = config
  for key in name.split("."):
    node = node[key] if isinstance(node, ConfigDict) and key in node else None
  if node is not None:
    return (f"unknown flag {given}: {name} is a field of {config_file}, set it with "
            f"--config.{name}={value}")
  return (f"{error} (--help lists the flags); config fields are set with "
          "--config.<field>=<value>, and --mode=config lists them")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors instead of usage dumps and chained tracebacks."""
  try:
    argv = _with_packaged_configs(argv)
    return flags.FLAGS(argv)
  except errors.UsageError as e:
    _fail(str(e))
  except flags.UnrecognizedFlagError as e:
    _fail(_unknown_flag(e, argv))
  except flags.Error as e:
    _fail(str(e))
  except (AttributeError, KeyError) as e:      # ml_collections: an override of a missing field
    _fail(_unknown_field(argv) or f"bad --config override: {e}")


def check_flags(argv: list[str]) -> None:
  """UsageError for leftover positional arguments and multi-host flags that do not fit."""
  if len(argv) > 1:
    raise errors.UsageError(f"unexpected arguments {argv[1:]}: flags take the form --name=value")
  n, i = _NUM_PROCESSES.value, _PROCESS_ID.value
  if not _COORDINATOR.value:
    if n is not None or i is not None:
      raise errors.UsageError("--num_processes/--process_id need --coordinator_address=HOST:PORT")
    return
  if not re.fullmatch(r"[^:\s]+:\d+", _COORDINATOR.value):
    raise errors.UsageError(f"--coordinator_address={_COORDINATOR.value}: expected HOST:PORT")
  if n is None or n < 1:
    raise errors.UsageError(f"--num_processes={n}: expected a positive int with a coordinator")
  if i is None or not 0 <= i < n:
    raise errors.UsageError(f"--process_id={i}: expected an int in [0, {n})")


def initialize() -> None:
  """Quiet library logging; with --coordinator_address, start the multi-host runtime once every
  process is there (train.distributed; StartupError after --init_timeout_s otherwise)."""
  logging.set_verbosity(logging.WARNING)
  if _COORDINATOR.value:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           timeout_s=_INIT_TIMEOUT_S.value)


def _remove_if_empty(path: str) -> None:
  try:
    os.rmdir(path)
  except OSError:  # not empty (something was written: keep it) or already gone
    pass


def workdir() -> str:
  return _WORKDIR.value


def config_lines(config, prefix: str = "config") -> list[str]:
  """Every field of `config` as the flag that sets it, `--config.model.d_model=32`."""
  lines = []
  for key in config.keys():
    value = config[key]
    if isinstance(value, ConfigDict) and value.keys():
      lines += config_lines(value, f"{prefix}.{key}")
    else:
      shown = ("{}" if isinstance(value, ConfigDict) else
               value if isinstance(value, str) and value else repr(value))
      lines.append(f"--{prefix}.{key}={shown}")
  return lines


def _file_config():
  """The --config file's config with the command's overrides; None without --config. (A file
  that does not load never gets here: `_with_packaged_configs` loads it first.)"""
  return _CONFIG.value


def run_config(config) -> ConfigDict:
  """eval/sample modes: the run's saved config, with the command's --config.<field> overrides."""
  saved = inference.load_config(workdir())
  if config is None:
    return saved
  overrides = config_flags.get_override_values(flags.FLAGS["config"])
  try:
    saved.update_from_flattened_dict(overrides)
  except (KeyError, AttributeError, TypeError) as e:
    raise errors.UsageError(f"cannot apply {sorted(overrides)} to the config of "
                            f"{workdir()} ({e})") from None
  return saved


def _evaluate(config) -> None:
  model, config, step = inference.load(workdir(), _STEP.value, config=config)
  metrics = inference.evaluate(model, config)
  if jax.process_index() == 0:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items(),
                                                         key=lambda kv: kv[0] != "eval_loss"))
    print(f"checkpoint {step} of {os.path.abspath(workdir())}, {config.eval_batches} "
          f"evaluation batches of {config.batch_size}: {shown}")


def _sample(config, sample: Callable) -> None:
  model, config, step = inference.load(workdir(), _STEP.value, config=config)
  text = sample(model, config)
  if jax.process_index() == 0:
    print(f"--- sample from checkpoint {step} of {os.path.abspath(workdir())} (prompt "
          f"{config.sample.prompt!r}, temperature {config.sample.temperature}) ---\n{text}\n---")


def run(train_and_evaluate: Callable, *, sample: Callable | None = None) -> None:
  """The binary's main: parse flags, check them and the workdir, initialize, then by --mode:
  train_and_evaluate(config, workdir); evaluate or sample (sample(model, config) -> str; without
  it the binary has no sample mode) the run in --workdir; or print the config's fields. Errors
  as described in the module docstring."""
  modes = [m for m in MODES if m != "sample" or sample is not None]

  def main(argv):
    # outside fit's own handlers, SIGTERM raises KeyboardInterrupt like SIGINT (caught below)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
      mode = _MODE.value
      if mode not in modes:
        raise errors.UsageError(f"--mode={mode}: this binary's modes are {', '.join(modes)}")
      config = _file_config()
      check_flags(argv)
      if mode in ("train", "config") and config is None:
        raise errors.UsageError(f"--config is required with --mode={mode}: the experiment's "
                                "config, e.g. --config=lm_smoke (or a file of your own)")
      if mode == "config":
        print(f"# {flags.FLAGS['config'].config_filename}, with this command's overrides; set "
              "any field with the flag as shown")
        print("\n".join(config_lines(config)))
        return
      if not workdir():
        raise errors.UsageError(f"--workdir is required with --mode={mode}: the run's "
                                "directory (checkpoints, metrics, config.json)")
      if mode == "train":
        created = not os.path.exists(workdir())
        trainer.prepare_workdir(workdir())       # fails in a second, before any compiling
        try:
          initialize()
          train_and_evaluate(config, workdir())
        except errors.UsageError:
          if created:                            # a rejected config leaves no empty run behind
            _remove_if_empty(workdir())
          raise
        return
      config = run_config(config)
      initialize()
      if mode == "eval":
        _evaluate(config)
      else:
        _sample(config, sample)
    except errors.UsageError as e:
      _fail(str(e))
    except (errors.TrainingError, errors.StartupError) as e:
      _fail(str(e), status=1)
    except KeyboardInterrupt:            # outside the training loop, or a second signal in it
      sys.stderr.write("interrupted: stopped without saving; the checkpoints in --workdir are "
                       "complete, rerun to resume from the newest\n")

  app.run(main, flags_parser=_parse_flags)
