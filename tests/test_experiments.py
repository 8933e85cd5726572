"""The experiment harness of RESULTS.md (experiments/): whole-split evaluation, the memory and
geometry tasks, the local-only Pack3D ablation, arm configs, resumable results."""

import importlib
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import common, geometry_task, memory_tasks, repacking
from neurips26_jax.jaxops import frac as frac_ops
from neurips26_jax.jaxops import packing
from neurips26_jax.models.lm import LanguageModel
from neurips26_jax.models.pack3d import Pack3DAttention
from neurips26_jax.train.data import synthetic


def _load_config(path):
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


# ----------------------------------------------------------------------------- LM evaluation

def test_whole_split_windows_score_every_character_once():
  from experiments.lm_shakespeare import whole_split_windows
  data = np.arange(1, 101, dtype=np.uint8)                 # 100 chars -> 99 targets
  inputs, targets, mask = whole_split_windows(data, 8)
  assert inputs.shape == targets.shape == mask.shape == (13, 8)
  assert mask.sum() == 99
  np.testing.assert_array_equal(targets[mask > 0], data[1:])
  np.testing.assert_array_equal(inputs[mask > 0], data[:-1])
  with pytest.raises(ValueError, match="at least 2"):
    whole_split_windows(data[:1], 8)


def test_whole_split_loss_is_the_mean_over_characters():
  from experiments.lm_shakespeare import whole_split_loss
  model = LanguageModel(d_model=16, num_layers=1, num_heads=2, context=8,
                        ffn_options={"d_ff": 16}, rngs=nnx.Rngs(0))
  data = np.random.default_rng(0).integers(0, 256, 38).astype(np.uint8)
  got = whole_split_loss(model, data, 8, batch=4)    # 37 targets: 5 windows, 3 pad ones
  x = jnp.asarray(data[:32].reshape(4, 8), jnp.int32)
  y = jnp.asarray(data[1:33].reshape(4, 8), jnp.int32)
  forward = nnx.jit(lambda m, t: m(t))
  ces = [np.asarray(optax.softmax_cross_entropy_with_integer_labels(forward(model, x), y))]
  tail = jnp.asarray(data[32:37][None], jnp.int32)   # the last, partial window: 5 targets
  ces.append(np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      forward(model, tail), jnp.asarray(data[33:38][None], jnp.int32))))
  np.testing.assert_allclose(got, np.concatenate([c.reshape(-1) for c in ces]).mean(),
                             rtol=1e-5)


def test_lm_arms_are_parameter_matched():
  from experiments.lm_shakespeare import check_matched
  base = _load_config("configs/exp_lm_shakespeare.py")
  counts = check_matched(base, list(base.experiment.order))
  assert set(counts) == set(base.experiment.order)
  assert 0.8e6 < counts["attention_swiglu"] < 0.9e6


@pytest.mark.parametrize("config", ["configs/exp_lm_ffn.py", "configs/exp_lm_ffn_large.py"])
def test_ffn_arms_have_the_head_width_their_name_says(config):
  """`flashffn_h<W>` arms are compared by head width, and the width follows d_model: an arm
  that set the 0.86M config's head count at d = 256 would run width 64 under the name h32."""
  from experiments.lm_shakespeare import arm_config, check_matched
  base = _load_config(config)
  check_matched(base, list(base.experiment.order))
  for arm in base.experiment.order:
    if not arm.startswith("flashffn_h"):
      continue
    kwargs = arm_config(base, arm, 0).model.to_dict()
    model = nnx.eval_shape(lambda: LanguageModel(**kwargs, rngs=nnx.Rngs(0)))
    ffn = model.blocks[0].ffn
    assert kwargs["d_model"] // ffn.num_heads == int(arm.removeprefix("flashffn_h")), arm


# ----------------------------------------------------------------------------- memory tasks

def test_lag_recall_lags_targets_and_mask():
  lags = (1, 4, 32)
  b = memory_tasks.lag_recall_lags(seed=0, stream=0, index=0, batch=6, length=48, vocab=10,
                                   lags=lags)
  for row in range(6):
    lag = lags[b["inputs"][row, 0] - synthetic.FIRST]
    np.testing.assert_array_equal(b["targets"][row, 33:], b["inputs"][row, 33 - lag:48 - lag])
  assert (b["mask"][:, :33] == 0).all() and (b["mask"][:, 33:] == 1).all()
  fixed = memory_tasks.lag_recall_lags(seed=0, stream=1, index=0, batch=3, length=48,
                                       vocab=10, lags=lags, lag_index=2)
  assert (fixed["inputs"][:, 0] == synthetic.FIRST + 2).all()
  with pytest.raises(ValueError, match="must exceed"):
    memory_tasks.lag_recall_lags(seed=0, stream=0, index=0, batch=1, length=32, vocab=10,
                                 lags=lags)


def test_mqar_gaps_point_at_the_pair():
  b = synthetic.mqar(seed=1, stream=0, index=0, batch=3, length=96, vocab=64, num_pairs=8)
  gaps = memory_tasks.mqar_gaps(b)
  for row, pos in zip(*np.nonzero(b["mask"])):
    value_pos = pos - gaps[row, pos]
    assert b["inputs"][row, value_pos - 1] == b["inputs"][row, pos]       # the key
    assert b["inputs"][row, value_pos] == b["targets"][row, pos]          # its value
  assert (gaps[b["mask"] == 0] == -1).all()
  acc = memory_tasks.bucket_accuracy(np.array([1, 0, 1, 1], bool), np.array([1, 3, 5, 9]),
                                     [1, 4, 8, 16])
  assert [a["accuracy"] for a in acc] == [0.5, 1.0, 1.0]


def test_value_recall_asks_for_the_one_value_at_every_lag():
  lags = (1, 2, 8, 20)
  b = memory_tasks.value_recall(seed=0, stream=0, index=0, batch=5, length=24, vocab=10,
                                lags=lags)
  pos = 1 + np.asarray(lags)
  assert (b["inputs"][:, 0] == memory_tasks.MARKER).all()
  assert (b["inputs"][:, pos] == memory_tasks.QUERY).all()
  np.testing.assert_array_equal(b["targets"][:, pos], np.repeat(b["inputs"][:, 1:2], 4, 1))
  assert (b["inputs"][:, 1] >= synthetic.FIRST).all() and b["mask"].sum() == 5 * len(lags)
  others = np.setdiff1d(np.arange(1, 24), pos)
  assert (b["inputs"][:, others] >= synthetic.FIRST).all() and (b["mask"][:, others] == 0).all()
  with pytest.raises(ValueError, match="at least max"):
    memory_tasks.value_recall(seed=0, stream=0, index=0, batch=1, length=21, vocab=10,
                              lags=lags)


def test_mamba2_state_arm_matches_frac_state():
  for path in ("configs/exp_frac_memory.py", "configs/exp_frac_memory_diag.py"):
    _check_state_arm(_load_config(path))


def _check_state_arm(base):
  from experiments.frac_memory import run_config
  for task, t in base.experiment.tasks.items():
    frac = run_config(base, task, "frac", 0)
    m2 = run_config(base, task, "mamba2_state", 0)
    modes = frac_ops.default_num_modes(t.length)
    assert m2.model.mixer_options["state_dim"] == modes * frac.model.mixer_options["state_dim"]
    assert run_config(base, task, "attention", 0).steps == t.steps_by_arm.get("attention",
                                                                             t.steps)


# ----------------------------------------------------------------------------- geometry task

def test_geometry_field_labels_need_near_and_far():
  rng = np.random.default_rng(0)
  block = np.array([2, 2, 2])
  for shape in [(8, 8, 8), (6, 8, 10), (10, 10, 5)]:
    feats, labels = geometry_task.field(rng, shape, block)
    assert feats.shape == (*shape, geometry_task.CHANNELS) and labels.shape == shape
    marker = np.argwhere(feats[..., 1:3].sum(-1) > 0)
    assert len(marker) == 1
    m = int(np.argmax(feats[tuple(marker[0])][1:3]))
    obj = feats[..., 0] > 0
    assert obj.any() and ((labels > 0) == obj).all()
    cells = np.argwhere(obj)
    assert (np.max(np.abs(cells // block - marker[0] // block), axis=1) >= 2).all()
    padded = np.pad(obj, 1)
    interior = np.ones(shape, bool)
    for axis in range(3):
      for step in (-1, 1):
        interior &= np.roll(padded, step, axis)[1:-1, 1:-1, 1:-1]
    expected = np.where(obj, 1 + 2 * m + (~interior).astype(int), 0)
    np.testing.assert_array_equal(labels, expected)


def test_geometry_cube_marker_fills_its_cube_far_from_objects():
  """marker="cube": every token of the marker's cube (and nothing else) carries the one-hot m,
  and every object token is two or more cubes away from it."""
  rng = np.random.default_rng(1)
  block = np.array([2, 2, 2])
  for shape in [(8, 8, 8), (6, 8, 10)]:
    feats, labels = geometry_task.field(rng, shape, block, marker_kind="cube")
    marker = np.argwhere(feats[..., 1:3].sum(-1) > 0)
    cubes = {tuple(c) for c in marker // block}
    assert len(cubes) == 1 and len(marker) == 8
    m = int(np.argmax(feats[tuple(marker[0])][1:3]))
    assert (feats[tuple(marker.T)][:, 1 + m] == 1).all() and (labels[tuple(marker.T)] == 0).all()
    cells = np.argwhere(labels > 0)
    assert ((labels[labels > 0] - 1) // 2 == m).all()
    assert (np.max(np.abs(cells // block - marker[0] // block), axis=1) >= 2).all()
  with pytest.raises(ValueError, match="marker"):
    geometry_task.field(rng, (8, 8, 8), block, marker_kind="corner")


def test_sweep_then_seeds_runs_each_arm_at_its_best_lr(tmp_path):
  """Every arm at every lr with the first seed, then the other seeds at that arm's best."""
  import ml_collections  # noqa: PLC0415
  base = ml_collections.ConfigDict({"optim": {"lr": 1.0},
                                    "experiment": {"lrs": (0.1, 0.2, 0.4)}})
  results, ran = common.Results("sweep", directory=tmp_path), []
  loss = {("a", 0.2): 1.0, ("b", 0.4): 2.0}

  def run_one(arm, lr, seed):
    key = common.run_key(common.run_label(base, arm, lr), seed)
    if not results.has(key):
      ran.append((arm, lr, seed))
      results.put(key, {"arm": arm, "lr": lr, "seed": seed, "loss": loss.get((arm, lr), 5.0)})

  common.sweep_then_seeds(base, ["a", "b"], [0, 1, 2], results, run_one, "loss")
  assert ran[:6] == [(a, lr, 0) for a in "ab" for lr in (0.1, 0.2, 0.4)]
  assert ran[6:] == [("a", 0.2, 1), ("b", 0.4, 1), ("a", 0.2, 2), ("b", 0.4, 2)]
  common.sweep_then_seeds(base, ["a", "b"], [0, 1, 2], results, run_one, "loss")
  assert len(ran) == 10                                # resumed: nothing ran twice
  assert common.run_label(ml_collections.ConfigDict({"optim": {"lr": 1.0}, "experiment": {}}),
                          "a", 1.0) == "a"             # one lr: the plain arm name


def test_a_stopped_run_ends_the_runner_unrecorded(monkeypatch):
  """SIGTERM stops fit at a checkpoint: the runner must exit, not record (and evaluate) the
  partly trained model as a finished run and go on to the next one."""
  import types  # noqa: PLC0415
  from neurips26_jax.train import trainer  # noqa: PLC0415
  monkeypatch.setattr(trainer, "fit", lambda *a: types.SimpleNamespace(stopped="SIGTERM"))
  with pytest.raises(SystemExit):
    common.fit(None, None, None, "arm/seed0")
  monkeypatch.setattr(trainer, "fit", lambda *a: types.SimpleNamespace(stopped=None))
  assert common.fit(None, None, None, "arm/seed0").stopped is None


def test_paired_interval_is_the_t_interval():
  ci = common.paired_interval([0.1, 0.2, 0.3])
  half = 4.303 * 0.1 / math.sqrt(3)
  np.testing.assert_allclose([ci["mean"], ci["low"], ci["high"]], [0.2, 0.2 - half, 0.2 + half])
  assert common.paired_interval([0.5])["low"] is None


def test_geometry_batch_relayout_and_metrics():
  kw = dict(items=2, fields_per_item=2, shapes=[(6, 8, 10), (8, 8, 8)], block_shape=(2, 2, 2),
            num_tokens=1024)
  b = geometry_task.batch(seed=0, stream=0, index=0, **kw)
  np.testing.assert_array_equal(b["tokens"], geometry_task.batch(seed=0, stream=0, index=0,
                                                                 **kw)["tokens"])
  for layout in packing.LAYOUTS:
    nb, perms = geometry_task.relayout(b, layout, block_shape=(2, 2, 2))
    for item, p in enumerate(perms):
      np.testing.assert_array_equal(nb["labels"][item], b["labels"][item][p])
      assert sorted(p.tolist()) == list(range(1024))
  m = geometry_task.token_metrics(b["labels"], b["labels"], b["mask"])
  assert m["acc_objects"] == m["acc_far_marker"] == m["acc_near_surface"] == 1.0
  wrong_m = np.where(b["labels"] > 0, (b["labels"] - 1 + 2) % 4 + 1, 0)
  m = geometry_task.token_metrics(wrong_m, b["labels"], b["mask"])
  assert m["acc_far_marker"] == 0.0 and m["acc_near_surface"] == 1.0


# ----------------------------------------------------------------------------- local-only

def test_local_only_merge_is_masked_local_attention():
  coords = packing.grid_coords((4, 4, 6))[None]            # one field, 2x2x3 cubes of 2^3
  fids = np.zeros(coords.shape[:2], np.int32)
  x = jax.random.normal(jax.random.key(0), (1, coords.shape[1], 12))
  layer = Pack3DAttention(12, 2, block_shape=(2, 2, 2), radius_blocks=0, position="none",
                          merge="local", impl="xla", rngs=nnx.Rngs(0))
  got = layer(x, coords, fids)
  qkv = (x @ layer.w_qkv[...].reshape(12, 36)).reshape(1, -1, 3, 2, 6)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  cube = coords[0] // 2
  local = (np.max(np.abs(cube[:, None] - cube[None]), -1) == 0)
  s = jnp.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(6)
  p = jax.nn.softmax(jnp.where(local, s, -jnp.inf), -1)
  want = jnp.einsum("bhij,bjhd->bihd", p, v).reshape(1, -1, 12) @ layer.w_out[...]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  joint = Pack3DAttention(12, 2, block_shape=(2, 2, 2), radius_blocks=0, position="none",
                          impl="xla", rngs=nnx.Rngs(0))
  assert float(jnp.max(jnp.abs(joint(x, coords, fids) - got))) > 1e-3
  with pytest.raises(ValueError, match="merge='local' needs impl"):
    Pack3DAttention(12, 2, merge="local", impl="pallas", position="none", rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- results file

def test_results_file_resumes(tmp_path):
  r = common.Results("demo", directory=tmp_path)
  assert not r.has("a/seed0")
  r.put("a/seed0", {"x": 1.5})
  r.set("throughput", {"a": 2})
  again = common.Results("demo", directory=tmp_path)
  assert again.has("a/seed0") and again.runs["a/seed0"]["x"] == 1.5
  assert again.data["throughput"] == {"a": 2}
  common.record_command(again)
  common.record_command(again)
  assert len(again.data["meta"]["commands"]) == 2
  assert again.data["meta"]["command"] == again.data["meta"]["commands"][-1]["command"]
  assert common.stats([1.0, 3.0])["mean"] == 2.0 and common.stats([2.0])["std"] == 0.0
  assert common.fmt(common.stats([1.0, 3.0]), 2) == "2.00 ± 1.41"
  assert common.selected(["a", "b"], "b") == ["b"]
  with pytest.raises(ValueError, match="unknown arms"):
    common.selected(["a"], "c")


def test_results_file_keeps_a_concurrent_runners_entries(tmp_path):
  """Two runners loaded the file before either wrote: neither save drops the other's runs."""
  first, second = (common.Results("demo", directory=tmp_path) for _ in range(2))
  first.put("a/seed0", {"x": 1})
  second.put("b/seed0", {"x": 2})
  second.set("profile", {"b": 1})
  first.put("a/seed1", {"x": 3})
  on_disk = common.Results("demo", directory=tmp_path)
  assert sorted(on_disk.runs) == ["a/seed0", "a/seed1", "b/seed0"]
  assert on_disk.data["profile"] == {"b": 1}


def test_far3d_report_shows_each_arm_at_its_own_best_lr():
  """A swept geometry experiment: the sweep table picks the highest accuracy per arm (at the
  first seed), and the per-layout and paired tables use only those runs (no rates mixed)."""
  from experiments import report
  layouts = ("raster_zyx", "raster_xyz", "morton", "hilbert", "cube_major", "shuffled_fields")

  def run(arm, lr, seed, acc):
    metrics = {"acc_objects": acc, "acc_tokens": acc, "acc_far_marker": acc,
               "acc_near_surface": acc, "max_logit_change": 0.0}
    ev = {name: {l: metrics for l in layouts} for name in ("train_shapes", "unseen_shapes")}
    return {"arm": arm, "lr": lr, "seed": seed, "params": 10, "wall_s": 60.0, "steps_per_s": 0.5,
            "eval": ev, "acc_objects_train_layout": acc}

  runs = [run("axial_rope", 1e-3, 0, 0.90), run("axial_rope", 2e-3, 0, 0.95),
          run("axial_rope", 2e-3, 1, 0.94), run("local_only", 1e-3, 0, 0.60),
          run("local_only", 2e-3, 0, 0.50), run("local_only", 1e-3, 1, 0.61),
          run("local_only", 2e-3, 1, 0.10), run("none", 1e-3, 0, 0.70), run("none", 2e-3, 0, 0.50),
          run("none", 2e-3, 1, 0.40)]
  d = {"meta": {"lrs": [1e-3, 2e-3]}, "runs": {f"{r['arm']}@{r['lr']}/{r['seed']}": r for r in runs}}
  text = report.repacking(d)
  assert "| `axial_rope` | 10 | n/a | 0.900 | 0.950 | 0.002 |" in text
  assert "| `local_only` | 10 | n/a | 0.600 | 0.500 | 0.001 |" in text
  # none's best rate has one seed so far: its rows stay at the rate with two, said so
  assert "axial_rope 0.002, local_only 0.001, none 0.002 (best 0.001: seeds pending)." in text
  assert "+0.350, +0.330 | +0.340" in text   # axial at 2e-3 minus local-only at 1e-3, per seed


def test_lm_ffn_report_pairs_widths_and_marks_partial_sweeps():
  """An arm with 2 of 3 rates run is shown at the better of the two, said so; head widths are
  paired against width 128 (same seed), but not across Pythons (two stdlib corpora)."""
  from experiments import report
  run = lambda arm, lr, seed, loss, py="3.12.1": {"arm": arm, "lr": lr, "seed": seed, "params": 9,
                                                  "val_loss_whole": loss, "python": py}
  runs = [run("swiglu", lr, 0, 1.5 + lr) for lr in (1, 2, 3)] + [run("swiglu", 1, 1, 1.6)]
  runs += [run("flashffn_h128", lr, 0, 1.6 + lr / 10) for lr in (1, 2, 3)]
  runs += [run("flashffn_h128", 1, 1, 1.7), run("flashffn_h32", 2, 0, 1.7),
           run("flashffn_h32", 3, 0, 1.8), run("flashffn_h32", 2, 1, 1.75)]
  d = {"meta": {"lrs": [1, 2, 3]}, "runs": {f"{i}": r for i, r in enumerate(runs)}}
  text = report.lm_ffn(d)
  assert "| `flashffn_h32` | 9 | n/a | - | 1.7000 | 1.8000 | pending |" in text
  assert "| `flashffn_h32` | 2 (best of 2 run) | 1.7000, 1.7500 |" in text
  assert "| `flashffn_h32` | -0.0000, +0.0500 | +0.0250 [" in text   # minus width 128 at lr 1
  d["runs"]["0"]["python"] = "3.11.7"
  assert "minus `flashffn_h128`" not in report.lm_ffn(d)


def test_throughput_interleaves_arms_and_keeps_each_best_round(monkeypatch):
  """`common.throughput`: each arm warmed up (3 steps) and then timed in rounds with the arms
  alternating (so a slow phase of the machine hits every arm), its best round per step; the
  step's state carries over (a timing of a stale state would retime the warm-up)."""
  from absl import flags  # noqa: PLC0415
  from experiments import report  # noqa: PLC0415
  monkeypatch.setattr(flags, "FLAGS", type("F", (), {"idle_load": 1e9, "idle_wait_s": 0})())
  clock, calls = iter(range(0, 1000, 1)), []
  monkeypatch.setattr(common.time, "perf_counter", lambda: float(next(clock)))

  def make(arm):
    def step(params, opt_state, batch):
      calls.append((arm, params))
      return params + 1, opt_state, jnp.zeros(())
    return step, 0, None, None

  t = common.throughput({"a": make("a"), "b": make("b")}, tokens_per_step=100, rounds=2,
                        per_round=2)
  assert [a for a, _ in calls] == ["a"] * 3 + ["b"] * 3 + ["a", "a", "b", "b"] * 2
  assert [p for a, p in calls if a == "a"] == list(range(7))
  assert t["arms"]["a"]["step_ms_all"] == [500.0, 500.0]      # 1 clock tick per 2 steps
  assert t["arms"]["b"]["tokens_per_s"] == 200.0
  line = report._throughput_line(t, ["b", "a"])
  assert "`b` 500 ms (1.00x), `a` 500 ms (1.00x)" in line


@pytest.mark.parametrize("config", ["exp_far3d", "exp_far3d_levels"])
def test_every_joint_arm_has_a_local_twin_with_its_parameters(config):
  """The far-branch-off evaluation builds each joint arm's local-only twin (multi-level options
  dropped, `pack3d_levels.OPTIONS`) and loads the arm's parameters into it."""
  base = importlib.import_module(f"neurips26_jax.configs.{config}").get_config()
  for arm in base.experiment.order:
    attention = repacking.arm_options(base, arm)
    if attention.get("merge", "joint") != "joint":
      continue
    model = nnx.eval_shape(lambda: repacking.make_model(base, attention, 0))
    twin = repacking.local_twin(base, attention, 0)
    assert (jax.tree.structure(nnx.state(twin, nnx.Param))
            == jax.tree.structure(nnx.state(model, nnx.Param))), arm


@pytest.mark.parametrize("radius", [0, 1])
def test_marker_reach_is_level2_cube_distance_to_the_marker(radius):
  """`marker_reach`: a token is within level-1 reach where its level-2 cube (coords // (2
  block): a level-2 cube is 2 x 2 x 2 level-1 cubes) is within `radius` of the marker's; each
  field against its own marker (two fields per item)."""
  block = (2, 2, 2)
  b = geometry_task.batch(seed=3, stream=0, index=0, items=2, fields_per_item=2,
                          shapes=[(16, 16, 16), (12, 8, 16)], block_shape=block,
                          num_tokens=2 * 4096, marker="cube")
  reach = repacking.marker_reach(b, block, radius)
  for i in range(2):
    for f in range(2):
      field = (b["field_ids"][i] == f) & (b["mask"][i] > 0)
      coords = b["coords"][i][field]
      marker = coords[b["tokens"][i][field][:, 1:3].sum(-1) > 0]
      assert len(marker) == 8                              # a whole 2^3 cube is the marker
      expect = np.abs(coords // 4 - marker[0] // 4).max(-1) <= radius
      np.testing.assert_array_equal(reach[i][field], expect)
      assert expect.any() and not expect.all()


def test_levels_report_splits_the_far_part_by_reach():
  """Rows with a reach split get the far-part table: marker class on, off, and per reach."""
  from experiments import report  # noqa: PLC0415
  layouts = ("raster_zyx", "raster_xyz", "morton", "hilbert", "cube_major", "shuffled_fields")

  def run(arm, seed, far, off, near, beyond):
    metrics = {"acc_objects": far, "acc_tokens": far, "acc_far_marker": far,
               "acc_near_surface": 1.0, "max_logit_change": 0.0}
    ev = {name: {l: metrics for l in layouts} for name in ("train_shapes", "unseen_shapes")}
    off_ev = {name: {l: {**metrics, "acc_far_marker": off} for l in layouts} for name in ev}
    return {"arm": arm, "lr": 2e-3, "seed": seed, "params": 10, "wall_s": 60.0,
            "steps_per_s": 0.5, "eval": ev, "far_off": off_ev, "acc_objects_train_layout": far,
            "reach": {"level1": near, "level2_only": beyond, "tokens_level1": 3,
                      "tokens_level2_only": 7}}

  runs = [run("axial_rope", 0, 1.0, 0.5, 1.0, 1.0), run("levels2", 0, 0.4, 0.6, 0.3, 0.4),
          run("levels2", 1, 0.6, 0.4, 0.5, 0.6)]
  d = {"meta": {"lrs": [2e-3]}, "runs": {f"{r['arm']}/seed{r['seed']}": r for r in runs}}
  text = report.repacking(d)
  assert "| `levels2` | 0.500 ± 0.141 | 0.500 ± 0.141 | 0.400 ± 0.141 | 0.500 ± 0.141 | 3 / 7 | 0, 1 |" in text
