"""Crash safety of the trainer, in process (fast): no non-finite checkpoint, SIGTERM/SIGINT save
once and return, a torn metrics line, a damaged newest checkpoint, a workdir of another model,
TensorBoard events on disk at every write. tests/test_trainer_kill.py does the same to a real
process from outside."""

import asyncio
import dataclasses
import os
import pathlib
import shutil
import signal

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from orbax.checkpoint._src.path import atomicity

from neurips26_jax.train import lm_task, trainer
from neurips26_jax.train.checkpoints import Checkpoints, NonFiniteStateError
from neurips26_jax.train.errors import UsageError
from neurips26_jax.train.metrics import MetricWriter, read_metrics
from tests.test_train import baseline, compilation_cache, config, losses  # noqa: F401 (fixtures)


@pytest.fixture(autouse=True)
def interactive_sigint():
  """SIGINT as in a foreground run. A test runner started in the background (nohup, `&` in a
  script, some CI runners) inherits SIGINT ignored, which the trainer rightly restores, and
  a second Ctrl-C then has nothing to stop."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  yield
  signal.signal(signal.SIGINT, before)


def checkpoint_names(workdir):
  return sorted(p.name for p in (pathlib.Path(workdir) / "checkpoints").iterdir())


@jax.custom_vjp
def nan_gradient_if(x, flag):
  """x itself; its gradient is NaN where flag is set (a finite loss with non-finite gradients)."""
  return x


nan_gradient_if.defvjp(lambda x, flag: (x, flag),
                       lambda flag, g: (jnp.where(flag, jnp.nan, g), None))


def test_nan_gradients_with_a_finite_loss_stop_before_any_save(tmp_path):
  """A finite loss with NaN gradients must not save a checkpoint full of NaN: the run stops at
  the step, before saving anything after it (that a rerun resumes from the good checkpoint is
  tests/test_train.py's NaN-loss test)."""
  c = config()
  task = lm_task.build_task(c)

  def loss_fn(model, batch):
    loss, aux = task.loss_fn(model, batch)
    return nan_gradient_if(loss, "poison" in batch and batch["poison"][0] > 0), aux

  poisoned = dataclasses.replace(
      task, loss_fn=loss_fn,
      train_batch=lambda s: {**task.train_batch(s), "poison": np.full(8, s == 5, np.float32)})
  with pytest.raises(trainer.NonFiniteLossError,
                     match=r"grad_norm is nan at step 5 .*newest checkpoint, step 4"):
    trainer.fit(c, tmp_path, poisoned)
  assert checkpoint_names(tmp_path) == ["4"]


def test_a_bad_batch_stops_before_it_reaches_the_model(tmp_path):
  """A target id past the vocabulary would silently read the last embedding row under jit; the
  task's host-side check (Task.check_batch) stops the run at that step, naming the field and
  the value, with nothing saved after the last good checkpoint."""
  c = config()
  task = lm_task.build_task(c)

  def train_batch(step):
    batch = dict(task.train_batch(step))
    if step == 5:
      batch["targets"] = batch["targets"].copy()
      batch["targets"][0, 3] = 300
    return batch

  with pytest.raises(trainer.BadBatchError,
                     match=r"training batch at step 5: `targets` .* token ids in \[0, "
                           r"vocab_size=256\); 1 of .*\(values in \[\d+, 300\]"):
    trainer.fit(c, tmp_path, dataclasses.replace(task, train_batch=train_batch))
  assert checkpoint_names(tmp_path) == ["4"]


def test_a_non_finite_state_is_never_saved(tmp_path):
  """Whatever the loss said: NaN/inf anywhere in params or optimizer state is refused, naming
  the step and the checkpoint a rerun would use, and nothing is written."""
  params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}
  tx = optax.adam(1e-3)
  good = {"step": jnp.int32(2), "params": params, "opt_state": tx.init(params)}
  c = Checkpoints(tmp_path, every=2, keep=3, last=10)
  c.save(2, good)
  for bad in ({**good, "params": {**params, "b": jnp.full(4, jnp.nan)}},
              {**good, "opt_state": jax.tree.map(lambda x: x * jnp.inf, tx.init(params))}):
    with pytest.raises(NonFiniteStateError, match=r"after step 4 .*newest checkpoint, step 2"):
      c.save(4, bad)
  c.close()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


@pytest.mark.parametrize("signum, mid_save", [(signal.SIGINT, False), (signal.SIGTERM, True)],
                         ids=["SIGINT_mid_step", "SIGTERM_mid_save"])
def test_a_signal_saves_the_step_under_way_once_and_returns(baseline, tmp_path, monkeypatch,
                                                            signum, mid_save):
  """SIGINT and SIGTERM complete a save in flight, save the step under way and return (no
  KeyboardInterrupt, no temporary folder left as the newest checkpoint); the rerun equals the
  uninterrupted run, also when a kill tore the last line of metrics.jsonl."""
  if mid_save:                          # checkpoints stay in their temporary folder for 1 s
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def slow_finalize(self, *args, **kwargs):
      await asyncio.sleep(1.0)
      return await finalize(self, *args, **kwargs)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", slow_finalize)
  c = config()
  task = lm_task.build_task(c)
  at = 4 if mid_save else 5             # save(4) starts just before train_batch(4)

  def signalled(step):
    if step == at:
      saving = [p.name for p in (tmp_path / "checkpoints").iterdir() if "tmp" in p.name]
      assert saving or not mid_save
      os.kill(os.getpid(), signum)
    return task.train_batch(step)

  stopped = trainer.fit(c, tmp_path, dataclasses.replace(task, train_batch=signalled))
  assert stopped.stopped == signum.name
  assert checkpoint_names(tmp_path) == ["4", str(at + 1)]
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == list(range(at + 1))
  assert not (tmp_path / "summary.json").exists()      # not a finished run
  assert signal.getsignal(signal.SIGINT) is signal.default_int_handler     # handlers restored
  monkeypatch.undo()
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write(f'{{"step": {at + 1}, "loss": 2.3')
  resumed = trainer.fit(c, tmp_path, task)
  assert resumed.stopped is None and losses(tmp_path) == losses(baseline[0])
  chex.assert_trees_all_equal(nnx.state(resumed.model, nnx.Param),
                              nnx.state(baseline[1].model, nnx.Param))


def test_a_second_sigint_stops_at_once(tmp_path):
  c = config()
  task = lm_task.build_task(c)

  def signalled_twice(step):
    if step == 1:
      os.kill(os.getpid(), signal.SIGINT)
      os.kill(os.getpid(), signal.SIGINT)
    return task.train_batch(step)

  with pytest.raises(KeyboardInterrupt):
    trainer.fit(c, tmp_path, dataclasses.replace(task, train_batch=signalled_twice))


def test_read_metrics_drops_only_a_torn_last_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "loss": 0.9}\n{"step": 2, "lo')
  assert read_metrics(path) == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.9}]
  path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo\n{"step": 2, "loss": 0.8}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON row"):
    read_metrics(path)


def damage(step_dir: pathlib.Path, how: str) -> None:
  for f in (f for f in step_dir.rglob("*") if f.is_file()):
    if how == "emptied":
      f.unlink()
    elif how == "truncated" and f.parent.name == "d":             # the array data files
      f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
    elif how == "metadata_cut" and f.name == "_METADATA":
      f.write_bytes(f.read_bytes()[:20])


# tensorstore may report a failed read's callback after orbax closed its event loop: noise
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["emptied", "truncated", "metadata_cut"])
def test_restore_skips_damaged_checkpoints(tmp_path, how, caplog):
  """Each kind of damage is skipped with a warning, never a raw tensorstore/orbax/JSON error."""
  state = lambda step: {"step": jnp.int32(step), "w": jnp.arange(12.0).reshape(3, 4) + step}
  c = Checkpoints(tmp_path, every=2, keep=5, last=6)
  for step in (2, 4, 6):
    c.save(step, state(step))
  c.close()
  damage(tmp_path / "6", how)
  damage(tmp_path / "4", "truncated")
  c = Checkpoints(tmp_path, every=2, keep=5, last=6)
  chex.assert_trees_all_equal(c.restore_latest(state(0)), state(2))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["2", "4.unreadable", "6.unreadable"]
  warned = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
  assert [m.split()[1] for m in warned] == ["6", "4"]
  assert c.due(4)            # the steps set aside will be saved again
  c.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_run_redoes_the_steps_after_a_damaged_newest_checkpoint(baseline, tmp_path):
  shutil.copytree(baseline[0], tmp_path, dirs_exist_ok=True)
  damage(tmp_path / "checkpoints" / "8", "truncated")
  c = config()
  result = trainer.fit(c, tmp_path, lm_task.build_task(c))
  assert checkpoint_names(tmp_path) == ["4", "8", "8.unreadable"]
  assert losses(tmp_path) == losses(baseline[0])
  chex.assert_trees_all_equal(nnx.state(result.model, nnx.Param),
                              nnx.state(baseline[1].model, nnx.Param))


def test_a_workdir_of_another_model_is_one_sentence(baseline, tmp_path):
  c = config()
  c.steps = 1
  trainer.fit(c, tmp_path, lm_task.build_task(c))
  c.model.d_model, c.model.ffn_options = 32, {"d_ff": 64}
  with pytest.raises(UsageError) as e:
    trainer.fit(c, tmp_path, lm_task.build_task(c))
  message = str(e.value)
  assert "different model" in message and "config.model.d_model was 16, now 32" in message
  assert "\n" not in message and e.value.__cause__ is None
  (tmp_path / "config.json").unlink()     # without the saved config: the first differing array
  with pytest.raises(UsageError, match=r"different model \(.* is \(\d+, 16\) float32 in the "
                                       r"checkpoint, \(\d+, 32\) float32 in the model\)"):
    trainer.fit(c, tmp_path, lm_task.build_task(c))


def tensorboard_events(tb_dir: pathlib.Path) -> list:
  """The events of the TFRecord files in tb_dir, file by file (no TensorBoard install needed)."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415
  events = []
  for path in sorted(tb_dir.glob("events.*")):
    data, pos = path.read_bytes(), 0
    while pos + 12 <= len(data):     # record: u64 length, u32 crc, data, u32 crc
      n = int.from_bytes(data[pos:pos + 8], "little")
      events.append(event_pb2.Event.FromString(data[pos + 12:pos + 12 + n]))
      pos += 12 + n + 4
  return events


def tensorboard_scalars(tb_dir: pathlib.Path) -> dict[str, list[int]]:
  """{tag: [steps]} of the scalar events in tb_dir."""
  out = {}
  for event in tensorboard_events(tb_dir):
    for v in event.summary.value:
      out.setdefault(v.tag, []).append(event.step)
  return out


def test_tensorboard_events_are_on_disk_after_each_write(tmp_path):
  """tensorboardX's SummaryWriter queued events for a thread and a kill lost them: every row
  must be on disk before close. A resumed writer marks its restart step for TensorBoard."""
  writer = MetricWriter(tmp_path, resume_step=0)
  for step in range(3):
    writer.write(step, {"loss": 1.0 / (step + 1)})
    assert tensorboard_scalars(tmp_path / "tb") == {"loss": list(range(step + 1))}
  resumed = MetricWriter(tmp_path, resume_step=2)
  (restart,) = [e for e in tensorboard_events(tmp_path / "tb") if e.HasField("session_log")]
  assert restart.step == 2 and restart.session_log.status == restart.session_log.START
  writer.close(), resumed.close()
