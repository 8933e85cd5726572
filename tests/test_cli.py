"""The binaries as a user drives them: train (the language model and the 3D segmenter), rerun
the finished run (it says so and changes nothing), evaluate and sample from the workdir, list
the config fields, --help. The command lines run in order through tests/binary_cases.py
(forked from one process that imported the binaries once), with DeprecationWarnings shown:
none may come from our code or JAX."""

import json
import os
import re
import subprocess
import sys

import pytest
from flax import nnx
from ml_collections import ConfigDict

from neurips26_jax.configs import lm_smoke
from neurips26_jax.models.lm import LanguageModel
from neurips26_jax.models.unet3d import param_count
from neurips26_jax.train.metrics import read_metrics
from tests.binaries import _DEPRECATION, REPO

LM, SEG = "neurips26_jax.train.train_lm", "neurips26_jax.train.train_seg3d"
TINY = ["--config=lm_smoke", "--config.steps=2", "--config.eval_every=2",
        "--config.eval_batches=1", "--config.data.max_bytes=100000", "--config.model.context=16",
        "--config.sample.num_tokens=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(the LM's workdir, {name: {"status", "output", "seconds"}}) for the command lines below,
  run in this order; the segmenter's result also names its "workdir"."""
  workdir, seg3d = tmp_path_factory.mktemp("lm"), tmp_path_factory.mktemp("seg3d")
  cases = {
      "train": (LM, [*TINY, f"--workdir={workdir}"]),
      "rerun": (LM, [*TINY, f"--workdir={workdir}", "--config.eval_every=1"]),
      "eval": (LM, [f"--workdir={workdir}", "--mode=eval"]),
      "sample": (LM, [f"--workdir={workdir}", "--mode=sample", "--config=lm_smoke",
                      "--config.sample.prompt=abc", "--config.sample.num_tokens=5"]),
      "missing_step": (LM, [f"--workdir={workdir}", "--mode=eval", "--step=1"]),
      # a config file's path, where the others name a packaged config
      "config": (LM, ["--config=configs/lm_smoke.py", "--mode=config", "--config.steps=7"]),
      "help_lm": (LM, ["--help"]),
      "help_seg3d": (SEG, ["--help"]),
      "train_seg3d": (SEG, ["--config=configs/seg3d_smoke.py", "--config.steps=1",
                            f"--workdir={seg3d}"]),
  }
  out = subprocess.run([sys.executable, "-m", "tests.binary_cases"], cwd=REPO, timeout=600,
                       input=json.dumps([{"module": m, "argv": a} for m, a in cases.values()]),
                       capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
                            "PYTHONWARNINGS": "default::DeprecationWarning",
                            # eval and sample reuse the programs the training run compiled
                            "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
                            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
  assert out.returncode == 0, out.stderr[-3000:]
  results = dict(zip(cases, json.loads(out.stdout)))
  # the imports' warnings print in the parent, before the fork; each child prints its own
  deprecated = [line for text in [out.stderr] + [r["output"] for r in results.values()]
                for line in text.splitlines() if _DEPRECATION.match(line)]
  assert not deprecated, "\n".join(deprecated)
  results["train_seg3d"]["workdir"] = seg3d
  return workdir, results


def ok(result) -> str:
  assert result["status"] == 0 and "Traceback" not in result["output"], result["output"][-3000:]
  return result["output"]


def test_training_prints_the_parameter_count_and_training_rates(runs):
  output = ok(runs[1]["train"])
  c = lm_smoke.get_config()
  c.model.context = 16
  count = param_count(nnx.eval_shape(lambda: LanguageModel(**c.model, rngs=nnx.Rngs(0))))
  assert f"LanguageModel: {count:,} parameters" in output
  bar = [line for line in output.splitlines() if line.startswith("[")]
  assert bar and all("inf" not in line for line in bar), bar
  assert "steps/s" not in bar[0] and re.search(r"2/2 loss .* steps/s .* tok/s \| eta", bar[-1])
  workdir = runs[0]
  assert "sample" in output and str(workdir) in output
  assert (workdir / "checkpoints" / "2").is_dir() and (workdir / "loss.png").exists()
  assert json.loads((workdir / "summary.json").read_text())["final_loss"] > 0


def test_seg3d_trains_one_step(runs):
  result = runs[1]["train_seg3d"]
  ok(result)
  workdir = result["workdir"]
  assert (workdir / "checkpoints" / "1").is_dir() and (workdir / "loss.png").exists()
  assert "eval_dice" in read_metrics(workdir / "metrics.jsonl")[-1]


def test_a_finished_run_rerun_says_so_and_changes_nothing(runs):
  workdir, results = runs
  first = ok(results["train"])
  final, eval_loss = re.search(r"final train loss (\S+), eval loss (\S+),", first).groups()
  output = ok(results["rerun"])
  assert "already complete at step 2" in output and "final train loss" not in output
  summary = json.loads((workdir / "summary.json").read_text())
  assert f"{summary['final_loss']:.4f}" == final and f"{summary['eval_loss']:.4f}" == eval_loss
  assert json.loads((workdir / "config.json").read_text())["eval_every"] == 2   # not the rerun's
  assert len(list((workdir / "tb").iterdir())) == 1                              # no new events


def test_eval_and_sample_from_the_workdir(runs):
  workdir, results = runs
  summary = json.loads((workdir / "summary.json").read_text())
  output = ok(results["eval"])
  assert f"checkpoint 2 of {workdir}" in output
  assert re.search(r"eval_loss (\S+)", output)[1] == f"{summary['eval_loss']:.4f}"
  output = ok(results["sample"])
  text = output.split(f"--- sample from checkpoint 2 of {workdir} (prompt 'abc'")[1]
  assert text.splitlines()[1].startswith("abc")
  missing = results["missing_step"]
  assert missing["status"] == 2 and missing["output"].strip().splitlines() == [
      f"error: no checkpoint at step 1 in {workdir}/checkpoints; the steps saved are [2] (a run "
      "keeps only its newest config.keep_checkpoints checkpoints)"]


def flat_fields(config, prefix="config") -> set[str]:
  out = set()
  for key in config.keys():
    value = config[key]
    if isinstance(value, ConfigDict) and value.keys():
      out |= flat_fields(value, f"{prefix}.{key}")
    else:
      out.add(f"{prefix}.{key}")
  return out


def test_mode_config_lists_every_field_as_its_flag(runs):
  lines = [l for l in ok(runs[1]["config"]).splitlines() if l.startswith("--config.")]
  assert {l[2:].split("=", 1)[0] for l in lines} == flat_fields(lm_smoke.get_config())
  assert "--config.steps=7" in lines and "--config.model.mixer=attention" in lines


@pytest.mark.parametrize("binary", ["help_lm", "help_seg3d"])
def test_help_lists_the_flags_and_how_to_list_the_config_fields(runs, binary):
  output = runs[1][binary]["output"]
  for flag in ("--config", "--workdir", "--mode", "--step", "--coordinator_address",
               "--num_processes", "--process_id", "--init_timeout_s"):
    assert f"  {flag}:" in output, (flag, output)
  assert "--mode=config" in output and "--config.<field>=<value>" in output
