"""The trainer and optimizer pinned to their documented semantics, against float64 numpy:
the learning-rate schedule (linear warmup, cosine to lr * min_lr_ratio), global-norm clipping
BEFORE AdamW (b1, b2, decoupled weight decay on matrices only), batches as functions of the
step, evaluation on the evaluation batches only, and bit-identical repeats and resumes.

A toy task (an affine map fitted by mean squared error) keeps every gradient analytic, so the
whole training trajectory can be recomputed here without the project's code.
"""

from __future__ import annotations

import math
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from neurips26_jax.configs import lm_smoke
from neurips26_jax.train import lm_task, losses, optim, seg3d_task, trainer
from neurips26_jax.train.metrics import read_metrics

OPTIM = dict(lr=0.05, warmup_steps=2, min_lr_ratio=0.2, weight_decay=0.3, b1=0.8, b2=0.9,
             clip_norm=1.0)
STEPS, EVAL_EVERY, EVAL_BATCHES = 6, 3, 2
W_TRUE = np.array([[1.0, -2.0], [0.5, 0.0], [-1.0, 3.0]])


def optim_config(**overrides):
  return ml_collections.ConfigDict({**OPTIM, **overrides})


def lr_formula(t, *, lr, warmup_steps, min_lr_ratio, steps, **_):
  """optim.py's docstring: lr t / warmup for t < warmup, then cosine from lr to
  lr * min_lr_ratio at `steps` (and there after)."""
  if t < warmup_steps:
    return lr * t / warmup_steps
  end = lr * min_lr_ratio
  progress = min(t - warmup_steps, steps - warmup_steps) / (steps - warmup_steps)
  return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * progress))


class AdamWNumpy:
  """clip_by_global_norm(clip), then AdamW (eps 1e-8, bias-corrected moments) with decoupled
  weight decay on parameters of ndim >= 2, at learning rate lr(t) for the t-th update."""

  def __init__(self, params, c, steps):
    self.c, self.steps, self.t = c, steps, 0
    self.m = {k: np.zeros_like(v) for k, v in params.items()}
    self.v = {k: np.zeros_like(v) for k, v in params.items()}

  def update(self, grads, params):
    c = self.c
    norm = math.sqrt(sum(float(np.sum(g * g)) for g in grads.values()))
    scale = min(1.0, c.clip_norm / norm)
    lr = lr_formula(self.t, steps=self.steps, **c)
    self.t += 1
    updates = {}
    for k, g in grads.items():
      g = g * scale
      self.m[k] = c.b1 * self.m[k] + (1 - c.b1) * g
      self.v[k] = c.b2 * self.v[k] + (1 - c.b2) * g * g
      m_hat, v_hat = self.m[k] / (1 - c.b1 ** self.t), self.v[k] / (1 - c.b2 ** self.t)
      decay = c.weight_decay * params[k] if params[k].ndim >= 2 else 0.0
      updates[k] = -lr * (m_hat / (np.sqrt(v_hat) + 1e-8) + decay)
    return updates


# ----------------------------------------------------------------------------- optimizer

@pytest.mark.parametrize("steps, warmup", [(20, 4), (3, 5)], ids=["cosine", "short_run"])
def test_schedule_values(steps, warmup):
  """A run shorter than its warmup stays in the warmup for all its steps."""
  c = optim_config(warmup_steps=warmup)
  lr = optim.schedule(c, steps)
  ts = (0, 1, 2, 3, 4, 5, 9, 12, 19, 20, 30) if steps > warmup else range(steps)
  for t in ts:
    np.testing.assert_allclose(float(lr(t)), lr_formula(t, steps=steps, **c), rtol=1e-5,
                               atol=1e-9, err_msg=f"step {t}")
  if steps > warmup:
    np.testing.assert_allclose(float(lr(warmup)), c.lr, rtol=1e-6)
    np.testing.assert_allclose(float(lr(steps)), c.lr * c.min_lr_ratio, rtol=1e-5)


def _grads(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {"w": scale * rng.normal(size=(3, 2)), "gain": scale * rng.normal(size=(5,))}


def _run(tx, params, grad_seq):
  """Updates of optax transform `tx` for the gradient sequence (float32 in, float64 out)."""
  f32 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)
  state, p, out = tx.init(f32(params)), f32(params), []
  for g in grad_seq:
    u, state = tx.update(f32(g), state, p)
    p = optax.apply_updates(p, u)
    out.append(jax.tree.map(lambda a: np.asarray(a, np.float64), u))
  return out


def test_optimizer_is_clip_then_adamw_as_configured():
  """make_optimizer against AdamWNumpy over 5 steps whose gradient norms straddle clip_norm
  (huge at step 2): clipping, b1/b2, decay mask and schedule all show in the updates."""
  c, steps = optim_config(), 10
  params = {"w": np.full((3, 2), 0.7), "gain": np.ones(5)}
  grad_seq = [_grads(0), _grads(1, 0.1), _grads(2, 1e4), _grads(3), _grads(4, 0.01)]
  got = _run(optim.make_optimizer(c, steps), params, grad_seq)
  ref, p = AdamWNumpy(params, c, steps), dict(params)
  for t, (g, u) in enumerate(zip(grad_seq, got)):
    expected = ref.update(g, p)
    p = {k: p[k] + expected[k] for k in p}
    for k in p:
      np.testing.assert_allclose(u[k], expected[k], rtol=2e-5, atol=1e-9, err_msg=f"{k} {t}")


def test_huge_gradient_updates_like_its_clipped_version():
  """Clipping acts on the gradient before Adam's moments: a gradient of norm 1e4 and the
  same gradient scaled to norm clip_norm give the same updates, then and afterwards (Adam
  alone is scale-free at its first step only; clipping after Adam would change the update)."""
  c = optim_config()
  params = {"w": np.full((3, 2), 0.7), "gain": np.ones(5)}
  huge = _grads(5, 1e4)
  norm = math.sqrt(sum(float(np.sum(g * g)) for g in huge.values()))
  clipped = {k: g * c.clip_norm / norm for k, g in huge.items()}
  later = [_grads(6), _grads(7, 0.05)]
  tx = optim.make_optimizer(c, 10)
  a, b = _run(tx, params, [_grads(8), huge, *later]), _run(tx, params, [_grads(8), clipped, *later])
  for ua, ub in zip(a, b):
    for k in ua:
      np.testing.assert_allclose(ua[k], ub[k], rtol=1e-5, atol=1e-9)
  unclipped = _run(optax.adamw(optim.schedule(c, 10), b1=c.b1, b2=c.b2,
                               weight_decay=c.weight_decay), params, [_grads(8), huge, *later])
  assert not np.allclose(unclipped[2]["gain"], a[2]["gain"], rtol=1e-3)


def test_scales_are_never_decayed_whatever_their_rank():
  """With zero gradients AdamW's update is the decay alone: it must be 0 for every norm gain
  (the LM's RMSNorm scales [d] and FlashFFN's per-head gain [H, d_h]) and for vectors, and
  -lr * wd * w for weight matrices (the FlashFFN tables, W_in, the embedding)."""
  from neurips26_jax.models.lm import LanguageModel  # noqa: PLC0415
  from tests.layer_formula_checks import build  # noqa: PLC0415
  model = build(LanguageModel, d_model=32, num_layers=1, num_heads=2, context=8, ffn="flashffn",
                ffn_options={"num_heads": 2})
  params = nnx.state(model, nnx.Param)
  c = optim_config(warmup_steps=0)
  tx = optim.make_optimizer(c, 10)
  updates = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])(
      params)           # one program (eagerly, every op of the update compiles its own)
  flat = dict(nnx.to_flat_state(updates))
  gains = [k for k in flat if k[-1] in ("norm_gain", "scale")]
  assert any(k[-1] == "norm_gain" and flat[k].ndim == 2 for k in gains)
  for path, u in flat.items():
    value = dict(nnx.to_flat_state(params))[path][...]
    decayed = -c.lr * c.weight_decay * value if value.ndim >= 2 and path not in gains else 0 * value
    np.testing.assert_allclose(u[...], decayed, rtol=1e-6, atol=1e-12, err_msg=str(path))


# ----------------------------------------------------------------------------- the trainer

class Affine(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.asarray(np.random.default_rng(0).normal(size=(3, 2)), jnp.float32))
    self.b = nnx.Param(jnp.zeros((2,), jnp.float32))

  def __call__(self, x):
    return x @ self.w[...] + self.b[...]


def toy_batch(stream: int, index: int) -> dict:
  """A pure function of (stream, index); training step 1 has a gradient far above clip_norm."""
  rng = np.random.default_rng([stream, index])
  x = rng.normal(size=(4, 3)) * (30.0 if (stream, index) == (0, 1) else 1.0)
  y = x @ W_TRUE + 0.1 * rng.normal(size=(4, 2)) + (2.0 if stream == 1 else 0.0)
  return {"x": x.astype(np.float32), "y": y.astype(np.float32)}


def toy_loss(model, batch):
  err = model(batch["x"]) - batch["y"]
  return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err))}


def toy_task(train_batch=None):
  return trainer.Task(model=Affine(), loss_fn=toy_loss,
                      train_batch=train_batch or (lambda step: toy_batch(0, step)),
                      eval_batch=lambda i: toy_batch(1, i), tokens_per_batch=4)


def toy_config():
  c = ml_collections.ConfigDict()
  c.steps, c.batch_size, c.log_every, c.eval_every = STEPS, 4, 1, EVAL_EVERY
  c.eval_batches, c.checkpoint_every, c.keep_checkpoints = EVAL_BATCHES, 3, 3
  c.compute_dtype = "float32"
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  c.optim = optim_config()
  return c


def numpy_loss_and_grads(p, batch):
  x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
  err = x @ p["w"] + p["b"] - y
  scale = 2.0 / err.size
  return float(np.mean(err ** 2)), {"w": scale * x.T @ err, "b": scale * err.sum(0)}


def numpy_trajectory():
  """Params before each step, the step's loss / grad norm / lr, and the final params."""
  model = Affine()
  p = {"w": np.asarray(model.w[...], np.float64), "b": np.asarray(model.b[...], np.float64)}
  opt, rows = AdamWNumpy(p, optim_config(), STEPS), []
  for step in range(STEPS):
    loss, g = numpy_loss_and_grads(p, toy_batch(0, step))
    rows.append({"params": p, "loss": loss, "lr": lr_formula(step, steps=STEPS, **OPTIM),
                 "grad_norm": math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))})
    u = opt.update(g, p)
    p = {k: p[k] + u[k] for k in p}
  return rows, p


def params_of(model):
  return {k: np.asarray(v, np.float64) for k, v in
          (("w", model.w[...]), ("b", model.b[...]))}


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("toy")
  return workdir, trainer.fit(toy_config(), workdir, toy_task())


def test_training_follows_the_numpy_trajectory(toy_run):
  """Batch t at step t, the loss and grad norm of the params before the step, lr(t), and
  params after STEPS clipped AdamW updates, all as computed here."""
  workdir, result = toy_run
  rows, final = numpy_trajectory()
  logged = [r for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r]
  assert [r["step"] for r in logged] == list(range(STEPS))
  assert rows[1]["grad_norm"] > 10 * OPTIM["clip_norm"]  # clipping is exercised
  for row, expected in zip(logged, rows):
    for key in ("loss", "grad_norm", "lr"):
      np.testing.assert_allclose(row[key], expected[key], rtol=2e-5, atol=1e-9,
                                 err_msg=f"{key} at step {row['step']}")
  for k, v in params_of(result.model).items():
    np.testing.assert_allclose(v, final[k], rtol=2e-5, atol=1e-7, err_msg=k)


def test_evaluation_reads_the_evaluation_batches(toy_run):
  """eval_loss after step s = mean over eval_batch(0 .. eval_batches - 1) at the params
  after that step (the evaluation stream is offset by 2, so the training batches give a
  different number)."""
  workdir, result = toy_run
  rows, final = numpy_trajectory()
  evals = [r for r in read_metrics(workdir / "metrics.jsonl") if "eval_loss" in r]
  assert [r["step"] for r in evals] == [EVAL_EVERY - 1, STEPS - 1]
  for row in evals:
    done = row["step"] + 1
    params = final if done == STEPS else rows[done]["params"]
    expected = np.mean([numpy_loss_and_grads(params, toy_batch(1, i))[0]
                        for i in range(EVAL_BATCHES)])
    on_train = np.mean([numpy_loss_and_grads(params, toy_batch(0, i))[0]
                        for i in range(EVAL_BATCHES)])
    np.testing.assert_allclose(row["eval_loss"], expected, rtol=2e-5)
    assert abs(on_train - expected) > 0.1 * expected
  np.testing.assert_allclose(result.eval_loss, evals[-1]["eval_loss"], rtol=1e-6)


def test_same_run_twice_and_resumed_is_bit_identical(toy_run, tmp_path):
  """Determinism: a second run, and a run stopped after its step-3 checkpoint and resumed,
  end with bit-identical parameters and log bit-identical losses."""
  workdir, result = toy_run
  expected = params_of(result.model)
  losses = lambda d: [r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r]
  again = trainer.fit(toy_config(), tmp_path / "again", toy_task())

  def preempted(step):
    if step == 4:
      raise KeyboardInterrupt("preempted")
    return toy_batch(0, step)

  with pytest.raises(KeyboardInterrupt):
    trainer.fit(toy_config(), tmp_path / "resumed", toy_task(preempted))
  resumed = trainer.fit(toy_config(), tmp_path / "resumed", toy_task())
  for run, name in ((again, "again"), (resumed, "resumed")):
    for k, v in params_of(run.model).items():
      np.testing.assert_array_equal(v, expected[k], err_msg=f"{name} {k}")
    assert losses(tmp_path / name) == losses(workdir), name


# ----------------------------------------------------------------------------- LM data

def test_text_evaluation_windows_come_from_the_validation_split(tmp_path):
  """With a corpus whose last val_fraction is digits and the rest letters, every evaluation
  window is digits only and every training window letters only; both vary with the index."""
  rng = np.random.default_rng(0)
  train_part = rng.choice(list(b"abcdefghijklmnopqrstuvwxyz"), 4000).astype(np.uint8)
  val_part = rng.choice(list(b"0123456789"), 1000).astype(np.uint8)
  path = tmp_path / "corpus.txt"
  path.write_bytes(train_part.tobytes() + val_part.tobytes())
  c = lm_smoke.get_config()
  c.data.path, c.data.val_fraction, c.data.max_bytes = str(path), 0.2, 0
  c.model.context, c.batch_size = 16, 8
  train_batch, eval_batch = lm_task.text_batches(c)
  digits, letters = set(b"0123456789"), set(b"abcdefghijklmnopqrstuvwxyz")
  seen = set()
  for i in range(20):
    e, t = eval_batch(index=i), train_batch(index=i)
    assert set(np.unique(e["inputs"])) | set(np.unique(e["targets"])) <= digits, i
    assert set(np.unique(t["inputs"])) | set(np.unique(t["targets"])) <= letters, i
    np.testing.assert_array_equal(e["inputs"][:, 1:], e["targets"][:, :-1])
    seen.add(e["inputs"].tobytes())
  assert len(seen) == 20
  # ... and the task the trainer gets uses these for evaluation
  task = lm_task.build_task(c)
  np.testing.assert_array_equal(task.eval_batch(3)["inputs"], eval_batch(index=3)["inputs"])
  np.testing.assert_array_equal(task.train_batch(3)["inputs"], train_batch(index=3)["inputs"])


def test_synthetic_evaluation_stream_differs_from_training():
  c = lm_smoke.get_config()
  c.data.kind, c.data.vocab, c.data.options = "mqar", 16, {"num_pairs": 2}
  c.model.context = 16
  train_batch, eval_batch = lm_task.synthetic_batches(c)
  assert not np.array_equal(train_batch(index=0)["inputs"], eval_batch(index=0)["inputs"])
  np.testing.assert_array_equal(eval_batch(index=0)["inputs"], eval_batch(index=0)["inputs"])


# ----------------------------------------------------------------------------- losses

def _log_softmax(z):
  z = z - z.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_lm_loss_is_the_masked_mean_cross_entropy():
  """lm_task.lm_loss: mean next-token cross entropy (nats) of the logits features @ head,
  over the masked positions when the batch has a mask, with the accuracy of the argmax there."""
  rng = np.random.default_rng(0)
  features, head = rng.normal(size=(2, 7, 5)), rng.normal(size=(5, 11))
  logits = features @ head
  targets = rng.integers(0, 11, (2, 7))
  mask = (rng.random((2, 7)) < 0.4).astype(np.float32)
  model = types.SimpleNamespace(features=lambda inputs: jnp.asarray(features, jnp.float32),
                                logits=lambda f: f @ jnp.asarray(head, jnp.float32))
  nll = -np.take_along_axis(_log_softmax(logits), targets[..., None], -1)[..., 0]
  loss, aux = lm_task.lm_loss(model, {"inputs": None, "targets": jnp.asarray(targets)})
  np.testing.assert_allclose(loss, nll.mean(), rtol=1e-5)
  assert aux == {}
  loss, aux = lm_task.lm_loss(model, {"inputs": None, "targets": jnp.asarray(targets),
                                      "mask": jnp.asarray(mask)})
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-5)
  correct = (logits.argmax(-1) == targets) * mask
  np.testing.assert_allclose(aux["accuracy"], correct.sum() / mask.sum(), rtol=1e-6)


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
def test_chunked_cross_entropy_is_the_whole_logits_loss(masked):
  """losses.chunked_cross_entropy, 3 chunks of 4 over L = 10 (the last one padded): the loss,
  the accuracy and the gradients of features and head equal masked_cross_entropy's on the
  whole logits; its backward holds one chunk's logits, not all L positions'."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 10, 6)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(6, 50)), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 50, (2, 10)))
  mask = jnp.asarray(rng.random((2, 10)) < 0.6, jnp.float32) if masked else None
  whole = lambda x, h: losses.masked_cross_entropy(x @ h, labels, mask)
  chunked = lambda x, h: losses.chunked_cross_entropy(x, lambda f: f @ h, labels, mask, chunk=4)
  np.testing.assert_allclose(chunked(x, head), whole(x, head), rtol=1e-6)
  grads = jax.grad(lambda *a: chunked(*a)[0], argnums=(0, 1))(x, head)
  grads_ref = jax.grad(lambda *a: whole(*a)[0], argnums=(0, 1))(x, head)
  for g, g_ref in zip(grads, grads_ref):
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-7)
  # The backward's logits are one chunk's [B, 4, V], recomputed: neither [B, L, V] nor the
  # chunks' logits stacked [3, B, 4, V] for the backward.
  text = jax.jit(jax.grad(lambda *a: chunked(*a)[0])).lower(x, head).as_text()
  assert "2x10x50xf32" not in text and "3x2x4x50xf32" not in text and "2x4x50xf32" in text


def test_segmentation_loss_and_macro_dice():
  """seg3d_task.segmentation_loss: voxel cross entropy over the real (mask 1) voxels, and
  macro Dice (2|P n G| + 1) / (|P| + |G| + 1) over the foreground classes 1..K-1 of the
  argmax prediction, inside the mask."""
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(3, 40, 4)) * 2
  labels = rng.integers(0, 4, (3, 40))
  mask = (rng.random((3, 40)) < 0.7).astype(np.float32)
  loss, aux = seg3d_task.segmentation_loss(jnp.asarray(logits, jnp.float32),
                                           jnp.asarray(labels), jnp.asarray(mask))
  nll = -np.take_along_axis(_log_softmax(logits), labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, (nll * mask).sum() / mask.sum(), rtol=1e-5)
  pred = logits.argmax(-1)
  dice = [(2 * ((pred == c) * (labels == c) * mask).sum() + 1)
          / (((pred == c) * mask).sum() + ((labels == c) * mask).sum() + 1) for c in (1, 2, 3)]
  np.testing.assert_allclose(aux["dice"], np.mean(dice), rtol=1e-6)
