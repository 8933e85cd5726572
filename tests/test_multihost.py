"""Multi-host on JAX's own runtime: the LM binary as two processes on this machine.

Two `python -m neurips26_jax.train.train_lm` processes (2 CPU devices each, a localhost coordinator,
jax.distributed.initialize, gloo collectives) train the mesh data=2 x fsdp=2, the data axis
across the processes. Their logged losses must equal a single-process run of the same config on
4 devices, only process 0 may print progress, the checkpoint they write together must resume in
one process, and a SIGTERM to one of them must stop both after the same step, saved. Slow
(35-110 s and 26-66 s on the shared 2-core CPU, by load): each process starts JAX and compiles.

Start-up (fast: no process gets past it): with a process missing, every process that came ends
within --init_timeout_s with one line naming the missing ones; a SIGTERM while waiting ends
the process quietly.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from ml_collections import ConfigDict

from neurips26_jax.configs import lm_smoke
from neurips26_jax.train import distributed, lm_task, trainer
from neurips26_jax.train.errors import StartupError
from neurips26_jax.train.metrics import read_metrics
from tests.binaries import REPO
from tests.test_train import compilation_cache  # noqa: F401  (autouse: the session's cache)

STEPS = 3                    # the two processes train 3 steps; the single process goes on to 5
OVERRIDES = {                # tiny model, one eval batch, a checkpoint at the end
    "steps": STEPS, "eval_every": STEPS, "eval_batches": 1, "checkpoint_every": STEPS,
    "optim.warmup_steps": 2, "data.max_bytes": 100_000, "sample.num_tokens": 4,
    "model.context": 16, "model.d_model": 16, "model.ffn_options.d_ff": 32,
    "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 1}
TIMEOUT_S = 300              # both processes, start-up and compiling included (~100 s loaded)
# float32 through another all-reduce (gloo between processes, XLA's within one): the gradients
# are summed in another order; observed differences are up to 2e-7 relative after a few steps
RTOL = 1e-5


def config(**changes) -> ConfigDict:
  c = lm_smoke.get_config()
  c.update_from_flattened_dict({**OVERRIDES, **changes})
  return c


def rows(workdir, key):
  return [r[key] for r in read_metrics(workdir / "metrics.jsonl") if key in r]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_two_processes(workdir, logdir, *, slow_step_s=0.0, devices=2, **changes):
  """Both processes of the train_lm binary with the same flags but --process_id, each
  with `devices` CPU devices (through tests.slow_binary, each batch `slow_step_s` slower, if
  given) -> ([Popen], [log path])."""
  flags = [f"--config.{k}={v}" for k, v in {**OVERRIDES, **changes}.items()]
  binary = "neurips26_jax.train.train_lm"
  module = ["tests.slow_binary", binary] if slow_step_s else [binary]
  common = [sys.executable, "-m", *module, "--config=configs/lm_smoke.py", *flags,
            f"--workdir={workdir}", f"--coordinator_address=localhost:{free_port()}",
            "--num_processes=2"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "SLOW_STEP_S": str(slow_step_s),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}   # not the suite's 8
  logs = [logdir / f"process_{i}.log" for i in range(2)]
  procs = []
  for i, log in enumerate(logs):
    with log.open("w") as f:
      procs.append(subprocess.Popen([*common, f"--process_id={i}"], cwd=REPO, env=env,
                                    stdout=f, stderr=subprocess.STDOUT))
  return procs, logs


def finish(procs, logs, deadline) -> list[str]:
  """Waits for both processes until `deadline` (time.monotonic()); asserts both exit 0, killing
  both if one fails or time runs out (so a test never hangs); -> their logs."""
  try:
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break                      # one failed: the other would wait for it until its timeout
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  status = [p.returncode for p in procs]
  assert status == [0, 0], "\n".join(
      f"process {i} (status {s}):\n{log.read_text()[-3000:]}"
      for i, (s, log) in enumerate(zip(status, logs)))
  return [log.read_text() for log in logs]


def meet(port, members, timeout_s=3.0) -> dict:
  """train.distributed's start-up meeting, one thread per (process_id, num_processes) in
  `members` -> {process_id: None or the StartupError's message}."""
  outcome = {}

  def one(i, n):
    try:
      distributed._Meeting(f"localhost:{port}", "localhost", port, n, i, timeout_s).run()
      outcome[i] = None
    except StartupError as e:
      outcome[i] = str(e)

  threads = [threading.Thread(target=one, args=member) for member in members]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout_s + 30)
  return outcome


def test_the_meeting_lets_everyone_through_when_all_are_there():
  assert meet(free_port(), [(2, 3), (0, 3), (1, 3)]) == {0: None, 1: None, 2: None}


@pytest.mark.parametrize("members, message", [
    ([(0, 3), (1, 3), (1, 3)], "two processes were started with --process_id=1"),
    ([(0, 2), (1, 3)], "process 1 was started with --num_processes=3 and process 0 with "
                       "--num_processes=2"),
], ids=["same_process_id", "different_num_processes"])
def test_the_meeting_refuses_misconfigured_processes_at_once(members, message):
  started = time.monotonic()
  outcome = meet(free_port(), members, timeout_s=20.0)
  assert time.monotonic() - started < 10
  assert outcome and all(message in m for m in outcome.values()), outcome


def start_alone(workdir, log, process_id, num_processes, port, timeout_s):
  """One process of a multi-host command whose other processes may never come -> Popen."""
  cmd = [sys.executable, "-m", "neurips26_jax.train.train_lm", "--config=configs/lm_smoke.py",
         f"--workdir={workdir}", f"--coordinator_address=localhost:{port}",
         f"--num_processes={num_processes}", f"--process_id={process_id}",
         f"--init_timeout_s={timeout_s}"]
  with log.open("w") as f:
    return subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})


def no_stack_dump(output: str) -> bool:
  return not any(s in output for s in ("Traceback", "Check failure", "DEADLINE_EXCEEDED", "@ "))


def test_missing_processes_are_named_within_the_timeout(tmp_path):
  """Process 0 of 2 alone, process 1 of 2 alone, and processes 0 and 1 of 3 (2 missing)."""
  wait_s = 4
  ports = [free_port() for _ in range(3)]
  runs = {"0 of 2": (0, 2, ports[0]), "1 of 2": (1, 2, ports[1]),
          "0 of 3": (0, 3, ports[2]), "1 of 3": (1, 3, ports[2])}
  started = time.monotonic()
  procs = {name: start_alone(tmp_path / name, tmp_path / f"{name}.log", *args, timeout_s=wait_s)
           for name, args in runs.items()}
  for p in procs.values():
    p.wait(timeout=wait_s + 120)
  seconds = time.monotonic() - started
  expected = {
      "0 of 2": "process 1 of --num_processes=2 did not reach the coordinator",
      "1 of 2": "process 0 (the coordinator) is not reachable at localhost:",
      "0 of 3": "process 2 of --num_processes=3 did not reach the coordinator",
      "1 of 3": "process 2 of --num_processes=3 did not reach the coordinator"}
  for name, p in procs.items():
    output = (tmp_path / f"{name}.log").read_text()
    lines = [line for line in output.splitlines() if line.strip()]
    assert p.returncode == 1 and no_stack_dump(output), (name, output)
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, output)
    assert expected[name] in lines[0] and f"--init_timeout_s={wait_s} s" in lines[0], lines
  assert seconds < wait_s + 60             # start-up of 4 processes on 2 loaded cores included


def test_sigterm_while_waiting_for_the_others_exits_quietly(tmp_path):
  port = free_port()
  p = start_alone(tmp_path / "run", tmp_path / "log", 0, 2, port, timeout_s=120)
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and p.poll() is None:     # until process 0 is waiting
    try:
      socket.create_connection(("localhost", port), timeout=1).close()
      break
    except OSError:
      time.sleep(0.2)
  p.send_signal(signal.SIGTERM)
  assert p.wait(timeout=30) == 0
  output = (tmp_path / "log").read_text()
  assert no_stack_dump(output) and output.strip().startswith("interrupted:"), output


@pytest.mark.slow
def test_two_processes_equal_one_process(tmp_path):
  multi = tmp_path / "multi"
  outputs = finish(*start_two_processes(multi, tmp_path), time.monotonic() + TIMEOUT_S)
  assert all("connected to 1 peer" in out for out in outputs)          # gloo, two processes
  progress = [[line for line in out.splitlines() if re.match(r"\[[#.]+\] \d+/", line)]
              for out in outputs]
  assert len(progress[0]) == STEPS and progress[1] == []                # process 0 only
  assert "parameters" in outputs[0] and "parameters" not in outputs[1]

  single = tmp_path / "single"            # one process, 4 of the suite's 8 devices, 5 steps
  c = config(steps=STEPS + 2)
  trainer.fit(c, single, lm_task.build_task(c))

  np.testing.assert_allclose(rows(multi, "loss"), rows(single, "loss")[:STEPS], rtol=RTOL)
  np.testing.assert_allclose(rows(multi, "eval_loss"), rows(single, "eval_loss")[:1], rtol=RTOL)
  # one writer (process 0): one row per step; the checkpoint holds both processes' shards
  assert rows(multi, "step") == [0, 1, 2, 2]
  assert sorted(p.name for p in (multi / "checkpoints").iterdir()) == [str(STEPS)]
  assert (multi / "sample.txt").exists() and (multi / "summary.json").exists()

  # the two processes' checkpoint resumes in one process and continues the single run's losses
  resumed = tmp_path / "resumed"
  shutil.copytree(multi, resumed)
  trainer.fit(c, resumed, lm_task.build_task(c))
  np.testing.assert_allclose(rows(resumed, "loss"), rows(single, "loss"), rtol=RTOL)


@pytest.mark.slow
def test_two_single_device_processes_equal_one_process_bit_for_bit(tmp_path):
  """data=2 over two processes of one device each against one process of two devices: the
  gradient all-reduce adds the same two numbers (gloo or XLA's), so every loss is identical."""
  mesh = {"mesh.fsdp": 1}
  finish(*start_two_processes(tmp_path / "multi", tmp_path, devices=1, **mesh),
         time.monotonic() + TIMEOUT_S)
  c = config(**mesh)
  trainer.fit(c, tmp_path / "single", lm_task.build_task(c))
  for key in ("loss", "eval_loss"):
    assert rows(tmp_path / "multi", key) == rows(tmp_path / "single", key)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
  """Saving is collective: a process that stopped alone would wait for the others forever."""
  procs, logs = start_two_processes(tmp_path / "run", tmp_path, slow_step_s=0.5, steps=20,
                                    checkpoint_every=100, **{"sample.num_tokens": 0})
  deadline = time.monotonic() + TIMEOUT_S
  while " 3/20 " not in logs[0].read_text() and time.monotonic() < deadline:  # process 0 prints
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.2)
  if procs[1].poll() is None:
    procs[1].send_signal(signal.SIGTERM)                              # process 1 only
  outputs = finish(procs, logs, deadline)
  stopped = [re.findall(r"SIGTERM: stopped after (\d+) of 20 steps", out) for out in outputs]
  assert stopped[0] == stopped[1] and len(stopped[0]) == 1, outputs
  step = stopped[0][0]
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [step]
