"""Bad command lines for the training binaries, as a table: each must end with exit status 2 and
one line `error: ...` naming the flag or config field, the value given and what was expected,
with no traceback. The cases run through tests/binary_cases.py: the real
binaries' __main__, forked from one process that imported them once (a few seconds in all)."""

import json
import os
import subprocess
import sys

import pytest

from neurips26_jax.configs import lm_smoke
from neurips26_jax.train import trainer
from neurips26_jax.train.errors import UsageError
from tests.binaries import REPO

LM = ("neurips26_jax.train.train_lm", "configs/lm_smoke.py")
SEG = ("neurips26_jax.train.train_seg3d", "configs/seg3d_smoke.py")
PACKAGED = "a packaged config is named without a path or .py (--config=lm_default), one of"
CORPUS = REPO / "README.md"
# (id, binary, flags, what the one line must contain)
CASES = [
    ("unknown_field", LM, ["--config.modle.d_model=8"],
     ["--config.modle.d_model", "no field config.modle", "'model'"]),
    ("unknown_nested_field", LM, ["--config.model.dmodel=8"],
     ["--config.model.dmodel", "no field config.model.dmodel", "'d_model'"]),
    ("field_below_a_value", LM, ["--config.steps.max=8"], ["--config.steps.max", "config.steps"]),
    ("not_an_int", LM, ["--config.steps=ten"], ["--config.steps=ten", "int"]),
    ("not_a_float", LM, ["--config.optim.lr=fast"], ["--config.optim.lr=fast", "float"]),
    ("zero_steps", LM, ["--config.steps=0"], ["config.steps must be a positive int, got 0"]),
    ("negative_log_every", LM, ["--config.log_every=-1"], ["config.log_every", "got -1"]),
    ("zero_keep_checkpoints", LM, ["--config.keep_checkpoints=0"],
     ["config.keep_checkpoints must be a positive int, got 0"]),
    ("negative_lr", LM, ["--config.optim.lr=-1"], ["config.optim.lr must be > 0, got -1"]),
    ("b2_out_of_range", LM, ["--config.optim.b2=1.5"], ["config.optim.b2", "[0, 1)", "1.5"]),
    ("bad_dtype", LM, ["--config.compute_dtype=float8"],
     ["config.compute_dtype must be one of", "'float8'"]),
    ("mesh_over_device_count", LM, ["--config.mesh.data=3"],
     ["config.mesh.data", "'data': 3", "does not divide the 1 devices"]),
    ("mesh_two_fill_axes", LM, ["--config.mesh.fsdp=-1"], ["at most one axis may be -1"]),
    ("mesh_zero", LM, ["--config.mesh.tensor=0"], ["config.mesh.tensor", "positive int or -1", "0"]),
    ("missing_data_file", LM, ["--config.data.path=/nonexistent/corpus.txt"],
     ["config.data.path='/nonexistent/corpus.txt'", "not a file", "expected a readable text file"]),
    ("data_path_is_a_directory", LM, ["--config.data.path=/tmp"],
     ["config.data.path='/tmp'", "not a file"]),
    ("corpus_too_short", LM, [f"--config.data.path={CORPUS}", "--config.data.max_bytes=20"],
     ["config.data.path=", "config.data.max_bytes=20", "cannot hold a window"]),
    ("unknown_data_kind", LM, ["--config.data.kind=images"],
     ["config.data.kind must be one of", "'images'"]),
    ("unknown_mixer", LM, ["--config.model.mixer=lstm"], ["config.model is invalid", "lstm"]),
    ("sample_past_context", LM, ["--config.sample.num_tokens=100"],
     ["config.sample.num_tokens", "100", "config.model.context = 32"]),
    # --config: a path that is not there, a packaged config's name misspelt, a config whose
    # get_config fails, each alone and with an override
    ("missing_config_file", LM, ["--config=configs/nope.py"],
     ["--config=configs/nope.py: no such config file", PACKAGED, "lm_smoke, seg3d_cells"]),
    ("missing_config_file_and_override", LM, ["--config=configs/nope.py", "--config.steps=2"],
     ["--config=configs/nope.py: no such config file", PACKAGED]),
    ("misspelt_config_name", LM, ["--config=lm_defualt"], ["--config=lm_defualt", PACKAGED]),
    ("misspelt_config_name_and_override", LM, ["--config=lm_defualt", "--config.steps=2"],
     ["--config=lm_defualt", PACKAGED]),
    ("bad_config_argument", LM, ["--config=lm_paper:13b"], ["--config=lm_paper:13b", "13b"]),
    ("bad_config_argument_and_override", LM, ["--config=lm_paper:13b", "--config.steps=2"],
     ["--config=lm_paper:13b", "13b"]),
    ("config_file_without_get_config", LM, ["--config=tests/__init__.py"],
     ["--config=tests/__init__.py", "defines no get_config()"]),
    ("syntax_error_in_config_file", LM, ["--config=README.md", "--config.steps=2"],
     ["--config=README.md: loading it raised SyntaxError"]),
    ("missing_workdir_flag", LM, "no workdir", ["--workdir"]),
    ("unwritable_workdir", LM, "workdir=/proc/not_here",
     ["--workdir=/proc/not_here", "expected a writable directory"]),
    ("workdir_is_a_file", LM, f"workdir={CORPUS}", [f"--workdir={CORPUS}", "writable directory"]),
    ("stray_argument", LM, ["stray"], ["unexpected arguments ['stray']", "--name=value"]),
    ("processes_without_coordinator", LM, ["--num_processes=2"],
     ["--num_processes/--process_id need --coordinator_address=HOST:PORT"]),
    ("process_id_out_of_range", LM,
     ["--coordinator_address=localhost:1234", "--num_processes=2", "--process_id=2"],
     ["--process_id=2", "[0, 2)"]),
    ("coordinator_without_port", LM,
     ["--coordinator_address=localhost", "--num_processes=1", "--process_id=0"],
     ["--coordinator_address=localhost", "HOST:PORT"]),
    ("num_processes_not_an_int", LM, ["--num_processes=two"], ["--num_processes=two", "int"]),
    ("config_field_as_a_flag", LM, ["--steps=5"],
     ["unknown flag --steps=5", "a field of configs/lm_smoke.py", "--config.steps=5"]),
    ("nested_config_field_as_a_flag", LM, ["--model.mixer=frac"], ["--config.model.mixer=frac"]),
    ("unknown_flag", LM, ["--stepz=5"], ["'stepz'", "--help", "--config.<field>=<value>",
                                         "--mode=config"]),
    ("unknown_mode", LM, ["--mode=infer"], ["--mode", "infer", "train"]),
    ("sample_mode_of_seg3d", SEG, ["--mode=sample"], ["--mode=sample", "train, eval, config"]),
    ("train_without_config", LM, "no config", ["--config is required", "train",
                                               "--config=lm_smoke"]),
    ("override_without_config", LM, ("no config", "--mode=sample", "--config.sample.prompt=hi"),
     ["--config.sample.prompt=hi", "no --config was given", "--config=lm_default"]),
    ("eval_of_a_workdir_without_a_run", LM, ["--mode=eval"], ["config.json", "workdir of a training run"]),
    ("negative_init_timeout", LM, ["--init_timeout_s=-1"], ["--init_timeout_s", "-1"]),
    ("seg3d_unknown_model_kind", SEG, ["--config.model.kind=vit"],
     ["config.model.kind must be one of", "'vit'"]),
    ("seg3d_patch_not_dividing_fields", SEG, ["--config.data.patch=(3, 3, 3)"],
     ["config.data is invalid", "(3, 3, 3)"]),
    ("seg3d_unknown_field", SEG, ["--config.data.shape=(8, 8, 8)"],
     ["--config.data.shape", "no field config.data.shape", "'shapes'"]),
]


def argv(binary, flags, workdir):
  module, config = binary
  if flags == "no workdir":
    return module, [f"--config={config}"]
  if flags == "no config":
    return module, [f"--workdir={workdir}"]
  if isinstance(flags, tuple):                      # ("no config", flag, ...)
    return module, [f"--workdir={workdir}", *flags[1:]]
  if isinstance(flags, str):                        # "workdir=PATH"
    return module, [f"--config={config}", f"--{flags}"]
  if flags[0].startswith("--config="):              # a config of the case's own
    return module, [f"--workdir={workdir}", *flags]
  return module, [f"--config={config}", f"--workdir={workdir}", *flags]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """{case id: {"status", "output", "seconds"}}, all cases in one driver process."""
  workdir = tmp_path_factory.mktemp("workdir")
  cases = [dict(zip(("module", "argv"), argv(binary, flags, workdir / name)))
           for name, binary, flags, _ in CASES]
  out = subprocess.run([sys.executable, "-m", "tests.binary_cases"], input=json.dumps(cases),
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
  assert out.returncode == 0, out.stderr[-3000:]
  return dict(zip((c[0] for c in CASES), json.loads(out.stdout)), workdirs=workdir)


@pytest.mark.parametrize("name, expected", [(c[0], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(results, name, expected):
  result = results[name]
  lines = [l for l in result["output"].splitlines() if l.strip()]
  error_lines = [l for l in lines if l.startswith("error: ")]
  assert result["status"] == 2, result["output"][-3000:]
  assert "Traceback" not in result["output"] and len(error_lines) == 1, result["output"][-3000:]
  for text in expected:
    assert text in error_lines[0], error_lines[0]


@pytest.mark.parametrize("name", ["zero_steps", "unknown_mixer", "missing_data_file"])
def test_a_rejected_config_leaves_no_empty_workdir(results, name):
  """The workdir a rejected training command created is removed again (it holds nothing)."""
  assert results[name]["status"] == 2
  assert not (results["workdirs"] / name).exists()


def test_an_unwritable_workdir_fails_before_anything_slow(results):
  """Checked before the model is built and compiled (that alone takes ~15 s)."""
  assert results["unwritable_workdir"]["seconds"] < 3.0


@pytest.mark.parametrize("field", ["keep_checkpoints", "optim.clip_norm", "mesh.tensor"])
def test_a_config_file_without_a_field_names_it(field):
  """A config file missing a field: one line naming the field, not a KeyError traceback."""
  c = lm_smoke.get_config()
  parent, _, leaf = field.rpartition(".")
  del (c[parent] if parent else c)[leaf]
  with pytest.raises(UsageError, match=f"config.{field} is missing"):
    trainer.check_config(c)
